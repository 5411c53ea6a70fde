"""An engine process that fails and signals SIGQUIT to the trainer (as SGLang's schedulers do) ends the pending
engine call with a megarl error, instead of the SIGKILL of the whole process tree that SGLang's own handler sends;
and an engine's log takes over its loggers' console output only."""

import asyncio
import io
import logging
import os
import signal
import socket
import sys
import threading
import time

import pytest

from megarl.rollout.enginelog import EngineLog
from megarl.rollout.failures import ChildWatch, EngineFailed, engine_call

WATCHED = (signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP)
"""What a ChildWatch takes over (each test gives them back)."""


@pytest.fixture(autouse=True)
def handlers():
    saved = {s: signal.getsignal(s) for s in WATCHED}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.remove_signal_handler(signal.SIGQUIT)
    loop.close()


def test_a_sigquit_during_an_engine_call_ends_it_with_the_phase_and_the_log(loop):
    log = EngineLog()
    log.lines.append("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    watch = ChildWatch(loop, log, "an SGLang engine process")
    threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGQUIT)).start()
    start = time.monotonic()
    with pytest.raises(EngineFailed) as failed, engine_call("wake", timeout_s=60), watch.alive():
        loop.run_until_complete(asyncio.sleep(30))  # a request the dead scheduler never answers
    assert time.monotonic() - start < 10
    text = str(failed.value)
    assert "during wake" in text and "SIGQUIT" in text and "OutOfMemoryError: CUDA out of memory" in text
    # The engine stays failed: the next call raises at once, without waiting on the loop.
    with pytest.raises(RuntimeError, match="signalled this one"), watch.alive():
        pytest.fail("a failed engine must not be called")


def test_a_sigquit_ends_a_call_blocked_outside_the_event_loop(loop):
    """What happened on the H200: the engine's scheduler was killed while the trainer trained, and the next call
    (wake) blocked in a socket send to it, inside the loop's first step, so a handler on the loop never ran."""
    watch = ChildWatch(loop, EngineLog(), "an SGLang engine process")
    ours, theirs = socket.socketpair()
    ours.settimeout(20)  # a regression fails the test instead of hanging it
    threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGQUIT)).start()
    start = time.monotonic()
    with pytest.raises(EngineFailed, match="during wake.*SIGQUIT"), engine_call("wake", timeout_s=60), watch.alive():
        ours.recv(1)  # blocks: nobody answers
    assert time.monotonic() - start < 10
    ours.close()
    theirs.close()


def test_a_sigquit_ends_a_call_on_an_event_loop_that_runs_signal_handlers_itself():
    """SGLang runs its calls on uvloop, which calls Python signal handlers from inside a loop callback and only
    logs what they raise (on the H200 the MoE run's call then waited for its deadline)."""
    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    previous = signal.getsignal(signal.SIGQUIT)
    try:
        watch = ChildWatch(loop, EngineLog(), "an SGLang engine process")
        threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGQUIT)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="SIGQUIT"), watch.alive():
            loop.run_until_complete(asyncio.sleep(30))
        assert time.monotonic() - start < 10
    finally:
        loop.close()
        signal.signal(signal.SIGQUIT, previous)


def test_a_sigquit_between_calls_fails_the_next_call(loop):
    watch = ChildWatch(loop, EngineLog(), "an SGLang engine process")
    os.kill(os.getpid(), signal.SIGQUIT)  # while no call runs: the loop sees it when it next runs
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="SIGQUIT"), watch.alive():
        loop.run_until_complete(asyncio.sleep(30))
    assert time.monotonic() - start < 10


def test_calls_without_a_signal_are_untouched(loop):
    watch = ChildWatch(loop, EngineLog(), "an SGLang engine process")
    with watch.alive():
        assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
    with pytest.raises(ValueError, match="engine's own"), watch.alive():
        raise ValueError("the engine's own error passes through")


def test_without_an_engine_loop_the_watch_still_ends_a_call():
    previous = signal.getsignal(signal.SIGQUIT)
    try:
        watch = ChildWatch(None, EngineLog(), "an SGLang engine process")
        with watch.alive():
            pass
        assert not watch.failed
        threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGQUIT)).start()
        with pytest.raises(RuntimeError, match="SIGQUIT"), watch.alive():
            time.sleep(30)
    finally:
        signal.signal(signal.SIGQUIT, previous)


def test_sigterm_taken_by_the_engine_loop_goes_back_to_the_trainers_handler(loop):
    """SGLang's tokenizer manager puts a SIGTERM handler on its loop (drain, then SIGKILL the process tree), over
    megarl's interrupt handling: the watch gives SIGTERM back, so scancel ends the run as an interrupt."""
    class Stopped(BaseException):
        pass

    def trainers(signum, frame):
        raise Stopped

    previous = signal.signal(signal.SIGTERM, trainers)
    try:
        loop.add_signal_handler(signal.SIGTERM, lambda: None)  # what the engine does on its first request
        ChildWatch(loop, EngineLog(), "an SGLang engine process", sigterm=trainers)
        with pytest.raises(Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_sigterm_during_an_engine_call_on_uvloop_ends_the_run_as_an_interrupt(signum):
    """On the H200: torchrun's SIGTERM reached the trainer inside a wake on SGLang's uvloop (which only logged the
    interrupt handler's exception) and the engine's scheduler, which died of it and signalled SIGQUIT; the run then
    ended as an engine failure. The interrupt now ends the call and wins over the failure it caused. A closed
    terminal's SIGHUP is an interrupt too."""
    from megarl.run.interrupt import Interrupted

    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    saved = {s: signal.getsignal(s) for s in WATCHED}

    def trainers(signum, frame):
        raise Interrupted(signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, trainers)
    try:
        watch = ChildWatch(loop, EngineLog(), "an SGLang engine process")
        threading.Timer(0.5, os.kill, args=(os.getpid(), signum)).start()
        threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGQUIT)).start()  # the scheduler, dying of it
        start = time.monotonic()
        with pytest.raises(Interrupted) as stopped, engine_call("wake", timeout_s=60), watch.alive():
            loop.run_until_complete(asyncio.sleep(30))
        assert stopped.value.signum == signum and time.monotonic() - start < 10
        time.sleep(1)  # the SIGQUIT has come
        with pytest.raises(Interrupted), watch.alive():  # and the next call is not an engine failure either
            pytest.fail("an interrupted run must not call its engine")
        # Between calls the signal goes to the trainer's handler.
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signum)
            time.sleep(5)
    finally:
        loop.close()
        for s, handler in saved.items():
            signal.signal(s, handler)


HANGING_START = """
import sys, threading
from pathlib import Path
from megarl.errors import at_failure
from megarl.run.command import run_main
from megarl.rollout.enginelog import EngineLog
from megarl.rollout.group import EngineGroup, start_engine

def engine():  # one that never comes up, its output going to its log as a real engine's does while it starts
    with EngineLog(Path(sys.argv[3])).capture():
        threading.Event().wait()

def main():
    at_failure(lambda: open(sys.argv[1], "w").write("marked failed"))
    group = EngineGroup(index=0, num_groups=1, size=1, rank_in_group=0, members=(0,), group=None)
    start_engine(group, engine, timeout_s=float(sys.argv[2]))

run_main(main)
"""


def test_an_engine_that_hangs_while_starting_ends_the_run_at_the_deadline(tmp_path):
    """Start-up is an engine call like the others: past rollout.timeout_minutes the run ends with one paragraph
    naming the phase and the deadline (on the console, not in the engine's log, and in the launcher's error
    file), exit code 2, and the run marked failed; the engine's processes then go with the trainer
    (test_engine_processes.py)."""
    import subprocess
    import sys

    from helpers import REPO

    error_file, marker = tmp_path / "errors", tmp_path / "marker"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HANGING_START, str(marker), "3", str(tmp_path / "engine_0.log")],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "MEGARL_ERROR_FILE": str(error_file)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - start < 30
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("megarl error: the rollout engine did not finish start-up within 3 s "
                           "(rollout.timeout_minutes = 0.05). Memory: host: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert error_file.read_text() == line + "\n" and marker.read_text() == "marked failed"


DEAD_RECEIVER = """
import sys, threading
from megarl.rollout.group import EngineGroup, GroupEngine

class Dead:  # an engine whose worker process died: its receiving call fails, the trainer's send never returns
    def receive_weights(self):
        raise RuntimeError("vLLM's engine core process ended (EngineCore_DP0 exit code -9)")

group = EngineGroup(index=0, num_groups=1, size=1, rank_in_group=0, members=(0,), group=None, gpus=(1,))
GroupEngine(group, Dead(), kind=None, timeout_s=600).receive(threading.Event().wait)
"""


def test_an_engine_apart_that_dies_during_a_push_ends_the_run_at_once_naming_it(tmp_path):
    """async_rl.engine_gpus: the trainer sends its part of a hand-over while its engine's workers receive theirs.
    A worker that dies leaves the send waiting on bytes nobody takes; the run ends at once with the engine's error
    (not after rollout.timeout_minutes, and not as the send's timeout), exit code 2, the run marked failed."""
    import subprocess
    import sys

    from helpers import REPO

    error_file = tmp_path / "errors"
    proc = subprocess.run([sys.executable, "-c", DEAD_RECEIVER], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "MEGARL_ERROR_FILE": str(error_file)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("megarl error: the rollout engine failed during hand-over: RuntimeError: vLLM's engine "
                           "core process ended (EngineCore_DP0 exit code -9) Memory: host: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and error_file.read_text() == line + "\n"


@pytest.fixture
def engine_loggers():
    """The engines' loggers ("sglang", "vllm") with no handlers, as a test sets them up; restored afterwards (an
    engine imported by an earlier test configured them)."""
    loggers = {name: logging.getLogger(name) for name in ("sglang", "vllm")}
    saved = {name: (list(lg.handlers), lg.propagate, lg.level) for name, lg in loggers.items()}
    for lg in loggers.values():
        lg.handlers, lg.propagate = [], True
        lg.setLevel(logging.INFO)
    yield loggers
    for name, lg in loggers.items():
        for h in lg.handlers:  # the engine logs' files (pytest's own capture handlers join non-propagating loggers)
            if isinstance(h.stream, io.TextIOWrapper) and h.stream.name not in (1, 2, "<stdout>", "<stderr>"):
                h.stream.close()
        lg.handlers, lg.propagate = saved[name][0], saved[name][1]
        lg.setLevel(saved[name][2])


def test_an_engines_log_takes_its_loggers_console_handlers_and_leaves_the_others(tmp_path, engine_loggers):
    """After an engine starts, its loggers' handlers that print to the console write into its log; one writing
    elsewhere keeps its stream. On the H200, pytest's capture handlers (StringIO), which pytest attaches to every
    non-propagating logger, were moved into a file by the next engine's start: 'getvalue' failed in pytest."""
    logger, captured = engine_loggers["sglang"], io.StringIO()
    with open(2, "w", closefd=False) as console:  # fd 2 stays open
        ours = [logging.StreamHandler(captured), logging.StreamHandler(console)]
        for h in ours:
            logger.addHandler(h)
        with EngineLog(tmp_path / "engine_0.log").capture():
            pass
        assert ours[0].stream is captured and ours[1].stream is not console
    logger.warning("after the start")
    assert "after the start" in (tmp_path / "engine_0.log").read_text()
    assert "after the start" in captured.getvalue()


def test_a_later_engines_log_takes_over_from_the_earlier_ones(tmp_path, engine_loggers):
    """The next engine's log moves the handlers the earlier one moved or added, closing its file, rather than
    adding more (which would write every line into both logs)."""
    captured = io.StringIO()
    vllm, sglang = engine_loggers["vllm"], engine_loggers["sglang"]
    vllm.addHandler(logging.StreamHandler(sys.__stderr__))  # vLLM's own console handler
    sglang.addHandler(theirs := logging.StreamHandler(captured))  # no console handler: the log adds one
    first = EngineLog(tmp_path / "engine_0.log")
    with first.capture():
        pass
    earlier = {h.stream for lg in (vllm, sglang) for h in lg.handlers if h is not theirs}
    with EngineLog(tmp_path / "engine_1.log").capture():
        pass
    assert len(vllm.handlers) == 1 and len(sglang.handlers) == 2 and theirs.stream is captured
    assert len(earlier) == 1 and next(iter(earlier)).closed
    vllm.warning("from vllm")
    sglang.warning("from sglang")
    assert (tmp_path / "engine_0.log").read_text() == ""
    assert "from vllm" in (tmp_path / "engine_1.log").read_text()
    assert "from sglang" in (tmp_path / "engine_1.log").read_text()


def test_the_groups_that_wait_out_a_generation_round_take_the_configured_timeouts(monkeypatch):
    """Engine groups and the gather of a round's results were gloo groups at torch's 30 minutes: a round longer
    than that killed the job with a raw gloo timeout whatever rollout.timeout_minutes said."""
    from datetime import timedelta

    import torch.distributed as dist

    from helpers import REPO
    from megarl.config import load_config
    from megarl.rollout.group import engine_group, engine_group_apart

    cfg = load_config(REPO / "recipes/tiny_cpu_grpo.yaml",
                      ["rollout.timeout_minutes=90", "parallel.timeout_minutes=10"])
    assert cfg.host_group_timeout() == timedelta(minutes=100)
    made = []
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: made.append(kwargs.get("timeout")))
    engine_group(0, [[0, 1], [2, 3]], cfg.host_group_timeout())
    engine_group_apart(0, 4, [[4], [5]], cfg.host_group_timeout())
    assert made == [timedelta(minutes=100)] * 4
