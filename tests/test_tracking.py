"""mlflow tracking: the flattened config as params and every step's metrics in a SQLite store, the same values
as metrics.jsonl; a store that cannot be opened stops with a UserError naming tracking.uri (exit code 2). The PPO
recipe's own store, written by train.py: test_train_recipe.py::test_tiny_ppo_recipe_with_critic_learns."""

import json

import pytest

from helpers import REPO, assert_mlflow_matches, only_mlflow_run, run_torchrun
from megarl.config import load_config
from megarl.errors import UserError
from megarl.loop.rl_step import Batch
from megarl.run.command import run_main
from megarl.run.tracking import Tracker

pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (requirements.txt)")
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH  # noqa: E402

GRPO = REPO / "recipes/tiny_cpu_grpo.yaml"

# Every metric the tracking issue asks for, by the name metrics.jsonl and mlflow share.
REQUIRED = ["reward_mean", "reward_std", "kl", "entropy", "actor/clip_fraction", "critic/value_loss",
            "actor/grad_norm", "critic/grad_norm", "actor/lr", "critic/lr", "response_length", "logprob_diff_mean",
            "logprob_diff_max", "time/generate", "time/reshard", "time/reference", "time/critic", "time/update",
            "tokens_per_s", "handover/copy_s", "handover/release_s"]


def tiny_batch(step: int) -> Batch:
    return Batch.build([[1, 2], [1, 3]], [[4, 5], [6]], [[-0.5, -1.0], [-2.0]], [float(step), 1.0])


def test_tracker_logs_to_an_explicit_uri_and_cuts_long_params(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray relative store would land here
    uri = f"sqlite:///{tmp_path / 'elsewhere' / 'store.db'}"
    long_path = "x" * (MAX_PARAM_VAL_LENGTH + 100)
    cfg = load_config(GRPO,
                      ["tracking.backend=mlflow", f"tracking.uri={uri}", "trainer.num_steps=2",
                       f"trainer.reward=megarl.rewards.{long_path}:reward"])
    tracker = Tracker(cfg, rank=0, out_dir=tmp_path / "run")
    for step in range(2):
        with tracker.phase("generate"):
            pass
        tracker.log(step, tiny_batch(step), {"actor/grad_norm": 0.5 + step, "logprob_diff_max": 0.0})
    tracker.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "run"]
    assert not (tmp_path / "run" / "mlflow.db").exists()
    client, run = only_mlflow_run(uri)
    reward = run.data.params["trainer.reward"]
    assert reward.startswith("megarl.rewards.xxx") and reward.endswith("...") and len(reward) == MAX_PARAM_VAL_LENGTH
    assert_mlflow_matches(client, run, tracker.history)
    assert tracker.history[1]["entropy"] == pytest.approx(3.5 / 3)


def test_metric_names_mlflow_refuses_are_logged_under_names_it_takes(tmp_path):
    """eval.num_samples > 1 logs eval/<set>/pass@k: mlflow refused the name and failed the run at its first
    evaluation. It logs pass_at_k; metrics.jsonl keeps the name megarl gives it."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    tracker = Tracker(load_config(GRPO, ["tracking.backend=mlflow", f"tracking.uri={uri}"]), rank=0,
                      out_dir=tmp_path / "run")
    tracker.log(0, tiny_batch(0), {"logprob_diff_max": 0.0, "eval/gsm8k/pass@4": 0.5, "eval/gsm8k/mean@4": 0.25})
    tracker.close()
    _, run = only_mlflow_run(uri)
    assert run.data.metrics["eval/gsm8k/pass_at_4"] == 0.5 and run.data.metrics["eval/gsm8k/mean_at_4"] == 0.25
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert logged["eval/gsm8k/pass@4"] == 0.5


def test_a_resumed_run_continues_its_mlflow_run_and_logs_each_step_once(tmp_path):
    """Checkpointed after step 0, interrupted after step 2: the resumed run logs steps 1 and 2 again, and
    both metrics.jsonl and the mlflow run then hold each step once, with the resumed values."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    run_dir = tmp_path / "run"
    first = Tracker(load_config(GRPO, ["tracking.backend=mlflow", f"tracking.uri={uri}", "trainer.num_steps=4"]),
                    rank=0, out_dir=run_dir)
    first.log(0, tiny_batch(0), {"logprob_diff_max": 0.0})
    saved = first.state_dict()  # what a checkpoint after step 0 keeps
    for step in (1, 2):
        first.log(step, tiny_batch(10 + step), {"logprob_diff_max": 0.0})
    first.close(status="KILLED")
    # Resumed with one more step configured: the same run goes on; changed params keep their first value.
    resumed = Tracker(load_config(GRPO, ["tracking.backend=mlflow", f"tracking.uri={uri}", "trainer.num_steps=5"]),
                      rank=0, out_dir=run_dir, start_step=1, run_id=saved["mlflow_run_id"])
    for step in (1, 2, 3):
        resumed.log(step, tiny_batch(step), {"logprob_diff_max": 0.0})
    resumed.close()
    client, run = only_mlflow_run(uri)
    assert run.info.run_id == saved["mlflow_run_id"] and run.data.params["trainer.num_steps"] == "4"
    rows = first.history[:1] + resumed.history
    assert_mlflow_matches(client, run, rows)
    assert run.data.metrics["reward_mean"] == rows[-1]["reward_mean"]  # the latest value is the last step's
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == rows
    discarded = [json.loads(line) for line in (run_dir / "metrics.discarded.jsonl").read_text().splitlines()]
    assert discarded == first.history[1:]


def test_other_ranks_open_no_store(tmp_path):
    cfg = load_config(GRPO, ["tracking.backend=mlflow"])
    tracker = Tracker(cfg, rank=1, out_dir=tmp_path / "run")
    tracker.log(0, tiny_batch(0), {"logprob_diff_max": 0.0})
    tracker.close()
    assert not (tmp_path / "run").exists() and tracker.mlflow is None


@pytest.mark.parametrize("uri", ["nosuchscheme://store", "sqlite:///{tmp}/a_file/mlflow.db", "sqlite:///{tmp}/a_file"])
def test_a_store_that_cannot_be_opened_names_tracking_uri(tmp_path, capsys, uri):
    (tmp_path / "a_file").write_text("not a database")
    cfg = load_config(GRPO,
                      ["tracking.backend=mlflow", f"tracking.uri={uri.format(tmp=tmp_path)}"])
    with pytest.raises(UserError, match="tracking.uri"):
        Tracker(cfg, rank=0, out_dir=tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda: Tracker(cfg, rank=0, out_dir=tmp_path / "run"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megarl error: tracking.uri = ") and "Traceback" not in err


@pytest.mark.slow
def test_train_reports_a_bad_store_before_building_anything(tmp_path):
    (tmp_path / "a_file").write_text("not a database")
    proc = run_torchrun(["megarl/train.py", "--config", str(GRPO), "--set", f"checkpoint.dir={tmp_path / 'run'}",
                         "--set", "tracking.backend=mlflow", "--set", f"tracking.uri=sqlite:///{tmp_path}/a_file"],
                        nproc=1, timeout=300)
    assert proc.returncode != 0 and "megarl error: tracking.uri = " in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr.split("megarl error")[0][-3000:]
    assert "vLLM" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()  # no engine started


ENDING = r"""
import errno, os, signal, sys, time
from megarl.run import interrupt
from megarl.config import load_config
from megarl.errors import UserError
from megarl.run.command import run_main
from megarl.loop.rl_step import Batch
from megarl.run.tracking import Tracker

def main():
    interrupt.install()
    cfg = load_config(sys.argv[1], ["tracking.backend=mlflow", "tracking.uri=" + sys.argv[2], "trainer.num_steps=2",
                                    "tracking.run_name=" + sys.argv[4]])
    tracker = Tracker(cfg, rank=0, out_dir=__import__("pathlib").Path(sys.argv[3]))
    tracker.end_with_the_process()
    tracker.log(0, Batch.build([[1, 2]], [[4, 5]], [[-0.5, -1.0]], [1.0]), {"logprob_diff_max": 0.0})
    how = sys.argv[4]
    if how == "user_error":
        raise UserError("step 1: reward of sample 0 = nan")
    if how == "crash":
        raise RuntimeError("a bug")
    if how == "disk_full":
        raise OSError(errno.ENOSPC, "No space left on device", "ckpt/.step_000001.tmp")
    if how == "dead_engine":  # an engine call that raises: EngineFailed, a UserError
        from megarl.rollout.failures import engine_call
        with engine_call("wake", timeout_s=60):
            raise RuntimeError("EngineCore died unexpectedly")
    if how == "hang":  # an engine call past its deadline (rollout.timeout_minutes), ended from the timer's thread
        import threading
        from megarl.rollout.failures import engine_call
        with engine_call("generate", timeout_s=2):
            threading.Event().wait()
    if how == "another_rank_failed":  # its paragraph in the launcher's error file, then torchrun's SIGTERM
        open(os.environ["MEGARL_ERROR_FILE"], "w").write("megarl error (rank 1): the rollout engine failed\n")
        how = "SIGTERM"
    if how in ("SIGTERM", "SIGINT", "SIGHUP"):
        os.kill(os.getpid(), getattr(signal, how))
        time.sleep(30)
    if how == "SIGINT_in_the_store":  # Ctrl-C arrives inside mlflow's transaction, after its INSERT, before its commit
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
        update = SqlAlchemyStore._update_latest_metrics_if_necessary
        def signalled(*args, **kwargs):
            update(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGINT)
        SqlAlchemyStore._update_latest_metrics_if_necessary = signalled
        tracker.log(1, Batch.build([[1, 2]], [[4, 5]], [[-0.5, -1.0]], [2.0]), {"logprob_diff_max": 0.0})
        print("the run went on past the signal", file=sys.stderr)
    tracker.close()

run_main(main)
"""


@pytest.mark.parametrize("how, code, status", [
    ("finish", 0, "FINISHED"), ("user_error", 2, "FAILED"), ("crash", 1, "FAILED"), ("disk_full", 1, "FAILED"),
    ("dead_engine", 2, "FAILED"), ("hang", 2, "FAILED"), ("another_rank_failed", 143, "FAILED"),
    ("SIGTERM", 143, "KILLED"), ("SIGINT", 130, "KILLED"), ("SIGHUP", 129, "KILLED"),
    ("SIGINT_in_the_store", 130, "KILLED")])
def test_the_mlflow_run_ends_with_the_status_of_the_process(tmp_path, mlflow_store, how, code, status):
    """Errors FAILED (before, mlflow's own exit hook marked them FINISHED, and a hung engine call left the run
    RUNNING), signals KILLED (SIGHUP left the run RUNNING and exited silently) unless another rank's error caused
    them, the last step FINISHED. A signal inside the store's transaction interrupts the run once the row is in
    (it left the store locked: the clean-up failed after 20 s with a traceback, and the run stayed RUNNING)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", ENDING, str(GRPO), mlflow_store, str(tmp_path / "run"), how], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin", "MEGARL_ERROR_FILE": str(tmp_path / "e")})
    assert proc.returncode == code, proc.stderr[-3000:]
    client, run = only_mlflow_run(mlflow_store, how)
    assert run.info.status == status
    if how == "SIGINT_in_the_store":
        assert [m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1.0, 2.0]
        assert "Traceback" not in proc.stderr and "failed" not in proc.stderr, proc.stderr[-3000:]
        assert "the run went on past the signal" not in proc.stderr
    else:
        assert run.data.metrics["reward_mean"] == 1.0  # the step logged before the end is kept
    if code > 128:
        name = signal.Signals(code - 128).name
        assert proc.stderr.strip().splitlines()[-1].startswith(f"megarl: interrupted by {name}"), proc.stderr


def test_a_steps_time_is_its_wall_time_and_throughput_leaves_out_only_its_evaluation(tmp_path, monkeypatch):
    """The sum of the phases misses what runs between them (advantages, a save, the loop itself): time/step is the
    wall clock from the step's first phase to its row, and tokens_per_s divides by it less the evaluation."""
    import megarl.run.tracking as tracking

    clock = [100.0]
    monkeypatch.setattr(tracking.time, "perf_counter", lambda: clock[0])
    tracker = Tracker(load_config(GRPO, ["tracking.backend=none"]), rank=0, out_dir=tmp_path / "run")

    def phase(name: str, seconds: float) -> None:
        with tracker.phase(name):
            clock[0] += seconds

    for step, (gap, eval_s) in enumerate([(1.5, 3.0), (0.5, 0.0)]):
        phase("generate", 2.0)
        clock[0] += gap  # work between phases
        phase("update", 1.0)
        phase("eval", eval_s)
        clock[0] += 0.25  # before the row is made
        tracker.log(step, tiny_batch(step), {"logprob_diff_max": 0.0})
        clock[0] += 10.0  # after a row and before the next step's first phase: not the next step's
    tracker.close()
    first, second = tracker.history
    tokens = sum(len(s) for s in tiny_batch(0).sequences)
    assert first["time/step"] == pytest.approx(7.75) and second["time/step"] == pytest.approx(3.75)
    assert first["tokens"] == tokens
    assert first["tokens_per_s"] == pytest.approx(tokens / 4.75)
    assert second["tokens_per_s"] == pytest.approx(tokens / 3.75)


def test_a_phases_last_time_is_its_latest_run_alone(tmp_path, monkeypatch):
    """Step 0's row adds the initial evaluation to the step's own (time/eval): the start-up line compares the
    first step without the step's evaluation alone (tracker.last), or its first step went negative."""
    import megarl.run.tracking as tracking

    clock = [0.0]
    monkeypatch.setattr(tracking.time, "perf_counter", lambda: clock[0])
    tracker = Tracker(load_config(GRPO, ["tracking.backend=none"]), rank=0, out_dir=tmp_path / "run")
    for seconds in (30.0, 20.0):  # the initial evaluation, then step 0's
        with tracker.phase("eval"):
            clock[0] += seconds
    assert tracker.last["eval"] == 20.0 and tracker.times["time/eval"] == 50.0


def test_a_resumed_rows_wall_time_adds_this_processs_part_to_the_checkpoints(tmp_path, monkeypatch):
    """A run stopped in the evaluation after its save finishes that step's row when it resumes: the row's time/step
    (up to the save) gains the resumed evaluation, so time/step - time/eval is the trained part, never negative."""
    import megarl.run.tracking as tracking

    clock = [50.0]
    monkeypatch.setattr(tracking.time, "perf_counter", lambda: clock[0])
    saved = {"step": 3, "time/step": 6.0, "tokens_per_s": 100.0, "reward_mean": 0.0, "response_length": 1.0}
    tracker = Tracker(load_config(GRPO, ["tracking.backend=none"]), rank=0, out_dir=tmp_path / "run", start_step=4,
                      unlogged={"row": saved, "evaluate": True})
    with tracker.phase("eval"):
        clock[0] += 4.0
    tracker.write(tracker.unlogged["row"] | {"logprob_diff_max": 0.0})
    tracker.close()
    [row] = tracker.history
    assert row["time/step"] == pytest.approx(10.0) and row["time/eval"] == pytest.approx(4.0)


def test_the_console_line_of_a_dynamic_sampling_run_gives_the_reward_of_the_samples_drawn(tmp_path):
    """The kept batch's reward_mean is chosen by the filter (0.5 with two samples a prompt): the line gives the
    samples drawn beside it."""
    tracker = Tracker(load_config(GRPO, ["tracking.backend=none", "trainer.num_steps=1"]), rank=0,
                      out_dir=tmp_path / "run")
    with tracker.console.capture() as captured:
        tracker.log(0, tiny_batch(0), {"logprob_diff_max": 0.0, "sampling/reward_mean_drawn": 0.125})
    tracker.close()
    assert "reward 0.500 (drawn 0.125) len" in captured.get()
