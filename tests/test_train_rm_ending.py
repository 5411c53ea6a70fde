"""How reward-model training ends (`python -m megarl.train_rm`), as train.py does: SIGTERM (scancel, a time limit)
with one line, exit code 143, its mlflow run KILLED holding every row of metrics.jsonl and only complete
checkpoints left; an error marks the mlflow run FAILED, the last step FINISHED; the stop file saves and stops."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, assert_mlflow_matches, only_mlflow_run
from megarl import errors
from megarl.config.reward_training import load_reward_training
from megarl.rm.log import RewardLog
from megarl.run import interrupt

pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (requirements.txt)")

RECIPE = REPO / "recipes/tiny_cpu_rm.yaml"


def command(out, *overrides: str) -> list[str]:
    """train_rm's arguments: a run in ``out`` far from its end that saves every step, logging to mlflow."""
    sets = (f"checkpoint.dir={out}", "tracking.backend=mlflow", "trainer.num_steps=400", "trainer.eval_every=0",
            "checkpoint.save_every=1", "checkpoint.keep_last=2", *overrides)
    return ["--config", str(RECIPE), *[a for o in sets for a in ("--set", o)]]


ENV = ({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGARL_DEBUG")}
       | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
"""One process, not torchrun's launcher: the signal reaches the trainer itself, as Slurm's reaches every rank."""


def assert_interrupted(stderr: str, code: int, out) -> list[dict]:
    """Exit code 143 with one line and no traceback, the mlflow run KILLED holding every row, only complete
    checkpoints left; the rows of metrics.jsonl."""
    assert code == 143, stderr[-3000:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith(
        "megarl: interrupted by SIGTERM"), stderr[-3000:]
    client, run = only_mlflow_run(f"sqlite:///{out / 'mlflow.db'}")
    assert run.info.status == "KILLED"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) < 400
    assert_mlflow_matches(client, run, rows)
    assert not list(out.glob(".step_*")), "a checkpoint the signal interrupted was left behind"
    return rows


@pytest.mark.slow
def test_sigterm_ends_the_run_with_one_line_and_its_mlflow_run_killed(tmp_path):
    """SIGTERM once metrics.jsonl has a row (a signal in a save abandons it): exit code 143, one line, no traceback;
    the mlflow run KILLED with every row, and only complete checkpoints. It used to die by the signal's default
    action, its mlflow run RUNNING for good."""
    out = tmp_path / "run"
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "megarl.train_rm", *command(out)], cwd=REPO, stdout=stdout,
                                stderr=stderr, env=ENV)
        try:
            metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
            while not (metrics.is_file() and metrics.read_text().strip()):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    assert_interrupted((tmp_path / "stderr").read_text(), proc.returncode, out)
    assert "metrics:" not in (tmp_path / "stdout").read_text()  # the finished run's line


SIGNAL_IN_SAVE = """
import os, signal, sys
import torch.distributed
from megarl import checkpoint
from megarl.checkpoint import saving
from megarl.run.command import run_main
from megarl.train_rm import main

WHERE = os.environ["SIGNAL_AT"]
save = checkpoint.save

def save_then_signal(directory, step, *args, **kwargs):  # SIGTERM the moment step 1's checkpoint is in place
    path = save(directory, step, *args, **kwargs)
    if step == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return path

class Dist:  # torch.distributed, as the saving module sees it, with SIGTERM after the second save's barrier
    barriers = 0

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    def barrier(self, *args, **kwargs):
        torch.distributed.barrier(*args, **kwargs)
        Dist.barriers += 1
        if Dist.barriers == 2:
            os.kill(os.getpid(), signal.SIGTERM)

if WHERE == "after_the_save":
    checkpoint.save = save_then_signal
else:
    saving.dist = Dist()
run_main(lambda: main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where, latest", [("after_the_save", "step_000001"), ("in_the_save", "step_000000")])
def test_a_signal_around_a_save_loses_no_row_and_leaves_no_partial_checkpoint(tmp_path, where, latest):
    """The step's row is logged before its checkpoint is saved: a signal once the checkpoint is in place finds the
    row logged, and the resumed run goes on from the next step. Logged after the save, the row of step 1 was lost
    for good (the resume starts at step 2); a row logged before a save the signal abandons is logged again by the
    resume from the checkpoint before (megarl.run.tracking.forget_jsonl_steps). A signal inside the save, once its
    directory exists (after the barrier that follows), abandons it: no .step_000001.tmp stays (one did, outside the
    clean-up's reach)."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_SAVE, *command(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=ENV | {"SIGNAL_AT": where})
    rows = assert_interrupted(proc.stderr, proc.returncode, out)
    assert (out / "latest").read_text().strip() == latest and [r["step"] for r in rows] == [0, 1]


@pytest.mark.slow
def test_the_stop_file_saves_and_stops_after_the_step(tmp_path):
    """checkpoint.stop_file (the Slurm launchers' answer to a time limit or a preemption) saves after the current
    step and ends the run with exit code 0, the stop file deleted so that the requeued job runs on; reward-model
    training used to ignore it and train on to the limit."""
    out, stop = tmp_path / "run", tmp_path / "stop"
    stop.touch()  # asked before the first step: the run stops after it
    proc = subprocess.run([sys.executable, "-m", "megarl.train_rm",
                           *command(out, "checkpoint.save_every=0", f"checkpoint.stop_file={stop}")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped after step 1" in proc.stdout and not stop.exists()
    assert (out / "latest").read_text().strip() == "step_000000"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    assert only_mlflow_run(f"sqlite:///{out / 'mlflow.db'}")[1].info.status == "FINISHED"


ROW = {"train/loss": 0.69, "train/accuracy": 0.5, "train/margin": 0.0, "train/grad_norm": 1.0, "train/lr": 1e-3,
       "time/step": 0.1}


@pytest.mark.parametrize("how, status", [("finish", "FINISHED"), ("error", "FAILED"), ("signal", "KILLED")])
def test_the_mlflow_run_ends_with_the_status_of_the_process(tmp_path, mlflow_store, monkeypatch, capsys, how, status):
    """The clean-ups run_main runs after an error (errors.failed) or a signal (interrupt.handle's) end the run FAILED
    or KILLED (an error used to leave it to mlflow's exit hook: FINISHED); closing again changes nothing."""
    monkeypatch.setattr(errors, "_at_failure", [])
    monkeypatch.setattr(interrupt, "_cleanups", [])
    cfg = load_reward_training(str(RECIPE), ["tracking.backend=mlflow", f"tracking.uri={mlflow_store}",
                                             f"tracking.run_name={how}", f"checkpoint.dir={tmp_path}",
                                             "trainer.num_steps=2"])
    log = RewardLog(cfg, tmp_path, rank=0)
    log.open(0)
    log.write(0, ROW)
    if how == "finish":
        log.write(1, ROW)
        log.close()
    elif how == "error":
        errors.failed()
    else:
        for cleanup in reversed(interrupt._cleanups):
            cleanup()
    log.close()
    client, run = only_mlflow_run(mlflow_store, how)
    assert run.info.status == status and log.jsonl is None
    assert_mlflow_matches(client, run, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
                                        .splitlines()])
    assert capsys.readouterr().out.count("megarl: metrics: ") == (how == "finish")


def test_an_error_before_the_first_step_records_a_failed_mlflow_run(tmp_path):
    """An error in the start-up's checks (here more pairs a step than the data holds) is one paragraph with exit
    code 2 and, with tracking.backend mlflow, a FAILED mlflow run holding the recipe's params, as train.py's start-up
    records one; it used to leave no run."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megarl.train_rm", *command(out, "data.pairs_per_step=100000")],
                          cwd=REPO, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 2 and "data.pairs_per_step" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
    _, run = only_mlflow_run(f"sqlite:///{out / 'mlflow.db'}")
    assert run.info.status == "FAILED" and run.data.params["data.pairs_per_step"] == "100000"
