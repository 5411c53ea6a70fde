"""benchmarks/step_table.py: a step's time is its wall time without its evaluation, from time/step or, for runs
that predate it, from the stamps of their console log; never the sum of the phases."""

import json
import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from step_table import summary  # noqa: E402


def write_run(tmp_path, rows, log_lines=None):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if log_lines is not None:
        (tmp_path / "run.log").write_text("\n".join(log_lines) + "\n")
    return run / "metrics.jsonl"


def test_wall_time_comes_from_time_step_less_the_evaluation(tmp_path):
    rows = [{"step": s, "time/generate": 1.0, "time/update": 1.0, "time/eval": 2.0 if s == 2 else 0.0,
             "time/step": 3.0 + (2.0 if s == 2 else 0.0), "response_length": 100.0} for s in range(3)]
    s = summary(write_run(tmp_path, rows), skip=1, samples=10)
    assert s["mean_s"] == pytest.approx(3.0) and s["phases_mean_s"] == pytest.approx(2.0)
    assert s["tokens_per_s"] == pytest.approx(2 * 100 * 10 / 6.0) and s["wall_from"] == "time/step"


def test_older_runs_take_their_wall_time_from_the_console_logs_stamps(tmp_path):
    rows = [{"step": s, "time/generate": 1.0, "time/eval": 0.0, "response_length": 50.0} for s in range(4)]
    log = ["[3s] megarl: starting", "[10s] step 1/4 reward", "[14s] step 2/4 reward", "[17s] step 3/4 reward",
           "[22s] step 4/4 reward"]
    s = summary(write_run(tmp_path, rows, log), skip=1, samples=2)
    assert s["mean_s"] == pytest.approx(4.0) and s["wall_from"] == "log stamps"  # (4 + 3 + 5) / 3, not 1.0
    assert s["tokens_per_s"] == pytest.approx(3 * 50 * 2 / 12)


def test_a_run_without_time_step_or_a_stamped_log_is_refused_by_name(tmp_path):
    path = write_run(tmp_path, [{"step": s, "time/generate": 1.0, "response_length": 5.0} for s in range(3)])
    with pytest.raises(SystemExit, match="no time/step .* no console log"):
        summary(path, skip=1, samples=1)
