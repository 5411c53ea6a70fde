"""How reward-model training ends (`python -m megarl.train_rm`), as train.py does: SIGTERM (scancel, a time limit)
with one line, exit code 143, its mlflow run KILLED holding every row of metrics.jsonl and only complete
checkpoints left; an error marks the mlflow run FAILED, the last step FINISHED."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO
from megarl import errors
from megarl.config.reward_training import load_reward_training
from megarl.rm.log import RewardLog
from megarl.run import interrupt

pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (requirements.txt)")
from mlflow import MlflowClient  # noqa: E402

RECIPE = REPO / "recipes/tiny_cpu_rm.yaml"


def only_run(uri: str, name: str | None = None):
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("megarl").experiment_id],
                               filter_string=f"tags.mlflow.runName = '{name}'" if name else "")
    return client, run


def assert_rows_in_mlflow(client: MlflowClient, run, rows: list[dict]) -> None:
    for name in {k for row in rows for k in row} - {"step"}:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert history == [(r["step"], r[name]) for r in rows if name in r], name


@pytest.mark.slow
def test_sigterm_ends_the_run_with_one_line_and_its_mlflow_run_killed(tmp_path):
    """SIGTERM once metrics.jsonl has a row, of a run far from its end that saves every step (a signal in a save
    abandons it): exit code 143, one line, no traceback; the mlflow run KILLED with every row, and only complete
    checkpoints. It used to die by the signal's default action, its mlflow run RUNNING for good."""
    out = tmp_path / "run"
    sets = [a for o in (f"checkpoint.dir={out}", "tracking.backend=mlflow", "trainer.num_steps=400",
                        "trainer.eval_every=0", "checkpoint.save_every=1", "checkpoint.keep_last=2")
            for a in ("--set", o)]
    env = ({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGARL_DEBUG")}
           | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "megarl.train_rm", "--config", str(RECIPE), *sets], cwd=REPO,
                                stdout=stdout, stderr=stderr, env=env)
        try:
            metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
            while not (metrics.is_file() and metrics.read_text().strip()):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("megarl: interrupted by SIGTERM"), \
        err[-3000:]
    client, run = only_run(f"sqlite:///{out / 'mlflow.db'}")
    assert run.info.status == "KILLED"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) < 400
    assert_rows_in_mlflow(client, run, rows)
    assert not list(out.glob(".step_*")), "a checkpoint the signal interrupted was left behind"
    assert "metrics:" not in (tmp_path / "stdout").read_text()  # the finished run's line


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the cases below: creating one costs seconds (mlflow's schema migrations)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'store.db'}"


ROW = {"train/loss": 0.69, "train/accuracy": 0.5, "train/margin": 0.0, "train/grad_norm": 1.0, "train/lr": 1e-3,
       "time/step": 0.1}


@pytest.mark.parametrize("how, status", [("finish", "FINISHED"), ("error", "FAILED"), ("signal", "KILLED")])
def test_the_mlflow_run_ends_with_the_status_of_the_process(tmp_path, store, monkeypatch, capsys, how, status):
    """The clean-ups run_main runs after an error (errors.failed) or a signal (interrupt.handle's) end the run FAILED
    or KILLED (an error used to leave it to mlflow's exit hook: FINISHED); closing again changes nothing."""
    monkeypatch.setattr(errors, "_at_failure", [])
    monkeypatch.setattr(interrupt, "_cleanups", [])
    cfg = load_reward_training(str(RECIPE), ["tracking.backend=mlflow", f"tracking.uri={store}",
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
    client, run = only_run(store, how)
    assert run.info.status == status and log.jsonl is None
    assert_rows_in_mlflow(client, run, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
                                        .splitlines()])
    assert capsys.readouterr().out.count("megarl: metrics: ") == (how == "finish")
