"""Where a run's start-up went (megarl.run.startup): one console line after the first step with every part, the
parts adding up to the total, SGLang's CUDA graph capture read from its log, and the first step against a steady one."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.run import startup

REPO = Path(__file__).resolve().parent.parent

SGLANG_LOG = (
    "Capturing num tokens (num_tokens=8 avail_mem=12.05 GB):  95%|#| 55/58 [01:03<00:00, 11.16it/s]"
    "Capturing num tokens (num_tokens=4 avail_mem=12.04 GB): 100%|##########| 58/58 [01:03<00:00,  1.09s/it]\n"
    "Capturing batches (bs=2 avail_mem=11.99 GB):  98%|#| 51/52 [00:05<00:00, 18.20it/s]"
    "Capturing batches (bs=1 avail_mem=11.99 GB): 100%|##########| 52/52 [00:05<00:00,  9.49it/s]\n")


@pytest.fixture
def clock(monkeypatch):
    """A fresh module whose clock reads what the test sets, in a process that started 2 s before the first mark."""
    mod = importlib.reload(startup)
    now = [100.0]
    monkeypatch.setattr(mod.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(mod, "process_age", lambda: 2.0)
    monkeypatch.setenv("RANK", "0")
    yield mod, now
    importlib.reload(startup)


def test_the_first_step_prints_every_part_adding_up_to_the_total(clock, tmp_path, capsys):
    mod, now = clock
    for part, seconds in [("imports", 0), ("config and data", 3), ("process groups", 1), ("models built", 4)]:
        now[0] += seconds
        mod.mark(part)
    mod.engine_log(tmp_path / "engine_0.log")
    (tmp_path / "engine_0.log").write_text(SGLANG_LOG)
    now[0] += 80
    mod.mark("engine start")
    now[0] += 0.5
    mod.mark("first weight push")
    now[0] += 10
    row = mod.step_ended()
    out = capsys.readouterr().out
    assert out.startswith("megarl: start-up 100.5 s: imports 2.0 s, config and data 3.0 s, process groups 1.0 s, "
                          "models built 4.0 s, engine start 80.0 s (of which SGLang's CUDA graph capture 68.0 s), "
                          "first weight push 0.5 s, first step 10.0 s"), out
    assert row["startup/engine_start_s"] == 80 and row["startup/first_step_s"] == 10
    assert sum(v for k, v in row.items() if k != "startup/total_s") == pytest.approx(row["startup/total_s"]) == 100.5
    now[0] += 4
    assert mod.step_ended() == {}
    assert capsys.readouterr().out == "megarl: the first step took 2.5x a steady one (10.0 s against 4.0 s)\n"
    now[0] += 4
    mod.mark("engine start")  # an engine restarted mid-run is not start-up
    assert mod.step_ended() == {} and capsys.readouterr().out == "" and mod._parts["engine start"] == 80


def test_the_capture_is_this_runs_in_a_log_earlier_runs_wrote_to(clock, tmp_path, capsys):
    """A run resumed in the same directory appends to the engine's log: the earlier run's 53 s capture (an H100's
    fresh start) is not this run's (7 s, its kernels cached), which counted 60 s before (gpu_round_af59f6c)."""
    mod, now = clock
    log = tmp_path / "engine_0.log"
    log.write_text("Capturing batches (bs=1 avail_mem=6.45 GB): 100%|##########| 52/52 [00:53<00:00,  1.04s/it]\n")
    mod.mark("models built")
    mod.engine_log(log)
    with log.open("a") as f:
        f.write("Capturing batches (bs=1 avail_mem=6.45 GB): 100%|##########| 52/52 [00:07<00:00,  7.11it/s]\n")
    now[0] += 20
    mod.mark("engine start")
    mod.engine_log(log)  # registered again for the same log (an engine restarted during start-up): still this run's
    mod.step_ended()
    assert "engine start 20.0 s (of which SGLang's CUDA graph capture 7.0 s)" in capsys.readouterr().out


def test_the_first_step_is_compared_with_a_steady_one_without_the_evaluations(clock, capsys):
    """Held-out evaluations after the first or the second step are not the steps' training: the first step's is a
    part of its own, and the comparison leaves both out."""
    mod, now = clock
    mod.mark("engine start")
    now[0] += 13
    row = mod.step_ended(aside=3.0)
    assert "first step 10.0 s, eval after the first step 3.0 s" in capsys.readouterr().out
    assert row["startup/first_step_s"] == 10 and row["startup/eval_after_the_first_step_s"] == 3
    assert row["startup/total_s"] == pytest.approx(sum(v for k, v in row.items() if k != "startup/total_s"))
    now[0] += 14
    mod.step_ended(aside=9.0)
    assert capsys.readouterr().out == "megarl: the first step took 2.0x a steady one (10.0 s against 5.0 s)\n"


def test_other_ranks_print_nothing_but_log_the_parts(clock, capsys, monkeypatch):
    mod, now = clock
    monkeypatch.setenv("RANK", "1")
    mod.mark("imports")
    now[0] += 1
    assert mod.step_ended()["startup/first_step_s"] == 1 and capsys.readouterr().out == ""


def test_graph_capture_needs_a_finished_bar():
    assert startup.graph_capture_s(SGLANG_LOG) == 68
    assert startup.graph_capture_s("Capturing batches (bs=1): 50%|#| 1/2 [00:05<00:05]") is None
    assert startup.graph_capture_s("Capturing batches (bs=1): 100%|#| 2/2 [1:02:03<00:00]") == 3723


def test_a_finished_bar_drawn_twice_is_one_capture():
    """tqdm drew the decode capture's finished bar at its last update and again at its close (an H100's log)."""
    twice = ("Capturing batches (bs=1 avail_mem=6.50 GB): 100%|##########| 52/52 [00:50<00:00,  9.93it/s]\n"
             "Capturing batches (bs=1 avail_mem=6.50 GB): 100%|##########| 52/52 [00:50<00:00,  1.03it/s]\n")
    assert startup.graph_capture_s(twice) == 50
    assert startup.graph_capture_s(SGLANG_LOG + twice) == 68 + 50


def test_the_process_age_counts_from_the_interpreter_start():
    """A new interpreter that sleeps a second reports at least that second, and no more than its whole life as its
    parent saw it (a clock tick of slack): the age counts from the process's start, not from an import."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(1.0); from megarl.run import startup; "
                          "print(startup.process_age())"], check=True, capture_output=True, text=True, cwd=REPO).stdout
    lived = time.monotonic() - start
    assert 1.0 <= float(out) <= lived + 2 / os.sysconf("SC_CLK_TCK")
