"""Engine failures as megarl errors: an engine call that raises stops training with one message naming the
phase, the engine's error and the memory in use; one that hangs ends the process after a deadline.

A colocated engine fails in ways the trainer cannot recover from (out of memory at wake, a dead worker
process), and under torchrun a raw exception on the driving rank reads as a crash of every rank. The
other ranks wait in a collective for the driver; once it exits, torchrun stops them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megarl.errors import UserError, failed, report
from megarl.platform.device import host_memory
from megarl.rollout.enginelog import EngineLog, console
from megarl.run.interrupt import Interrupted


class EngineFailed(UserError):
    """The rollout engine failed (reported as one paragraph; the last complete checkpoint is intact)."""

    on_every_rank = False  # only the engine's driver sees it


def memory_summary() -> str:
    """What this machine's memory holds now: per visible GPU, or the host's."""
    if torch.cuda.is_available():
        parts = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            parts.append(f"GPU {i}: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use, this process "
                         f"{torch.cuda.memory_reserved(i) / 2**30:.1f} GiB reserved")
        return "; ".join(parts)
    host = host_memory()
    if host is None:
        return "host memory unknown"
    total, used = host
    return f"host: {used / 2**30:.1f} of {total / 2**30:.1f} GiB in use"


CLEANUP_S = 60.0
"""How long the clean-ups after a hang may take before the process ends without them."""


def _hung(phase: str, timeout_s: float) -> None:
    """The deadline of an engine call passed: the main thread is stuck inside it."""
    end_run(f"the rollout engine did not finish {phase} within {timeout_s:.0f} s (rollout.timeout_minutes = "
            f"{timeout_s / 60:.3g}). Memory: {memory_summary()}. Training stopped; the last complete checkpoint is "
            "intact. Look at the engine's log (engine_*.log in the run directory) for the cause, or raise "
            f"rollout.timeout_minutes if {phase} is legitimately that slow.")


def end_run(message: str) -> None:
    """From a thread other than the main one, which is stuck where no exception reaches it (a wait in C, a loop
    that swallows what signal handlers raise, a collective whose peer is gone): report ``message`` as run_main
    would (stderr, the launcher's error file), mark the run failed (errors.at_failure) and end the process; the
    engine's watchdog then ends the engine's processes (megarl.rollout.watchdog)."""
    rank = os.environ.get("RANK")
    with os.fdopen(os.dup(console()), "w") as stderr:  # not into the log of an engine that hangs while it starts
        report(("megarl error: " if rank in (None, "0") else f"megarl error (rank {rank}): ") + message, stderr)
    backstop = threading.Timer(CLEANUP_S, os._exit, args=(2,))
    backstop.daemon = True
    backstop.start()
    failed()
    os._exit(2)


IN_TRAINING = ("The engine's log is engine_*.log in the run directory. Training stopped; the last complete "
               "checkpoint is intact and resumes with checkpoint.resume: auto. If the engine ran out of memory, lower "
               "rollout.gpu_memory_fraction or enable offloading (actor.offload_optimizer, actor.offload_weights, "
               "critic.offload_weights, reference.offload_weights).")
"""Where a training run's engine logs, and what to do about its failure."""


@contextmanager
def engine_errors(phase: str, after: str = IN_TRAINING) -> Iterator[None]:
    """An exception of the engine becomes EngineFailed: one paragraph naming ``phase``, the engine's error and the
    memory in use, then ``after`` (where its log is, what to do)."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        text = " ".join(str(err).split())[-1500:] or "(no message)"
        raise EngineFailed(f"the rollout engine failed during {phase}: {type(err).__name__}: {text} Memory: "
                           f"{memory_summary()}. {after}") from err


@contextmanager
def engine_call(phase: str, timeout_s: float) -> Iterator[None]:
    """Guard one engine call: an exception becomes EngineFailed; no return within timeout_s ends the process."""
    timer = threading.Timer(timeout_s, _hung, args=(phase, timeout_s))
    timer.daemon = True
    timer.start()
    try:
        with engine_errors(phase):
            yield
    finally:
        timer.cancel()


TERMINATING = (signal.SIGTERM, signal.SIGHUP)
"""Signals that end the run as an interrupt, which an engine call on uvloop would swallow."""


class EngineProcessDied(Exception):
    """Raised in the main thread by the SIGQUIT handler, out of whatever an engine call blocks in."""


class ChildWatch:
    """An engine whose processes signal SIGQUIT to this one when they fail (SGLang's schedulers do, and SGLang's
    own handler then SIGKILLs the whole process tree, this process included: the user would see only
    torchrun's ChildFailedError). This process's handler replaces the engine's: during an engine call it stops
    the engine's event loop and raises in the main thread, which ends the call wherever it blocks (a socket send
    to the dead process, where a handler on the loop would never run; a wait on the loop, where uvloop, which
    SGLang uses, runs the handler inside a loop callback and only logs what it raises), and ``alive`` raises,
    naming the engine log's root cause; between calls it marks the engine failed, and the next call raises
    before it starts.

    SIGTERM (scancel, a Slurm time limit; torchrun sends it to the whole process group, the engine's processes
    too) or SIGHUP (a closed terminal) arriving during an engine call ends the call the same way and ``alive``
    raises ``Interrupted``: uvloop would swallow the trainer's own handler's exception, and the engine processes'
    death from the same signal must read as the interrupt, not as an engine failure. Between calls the trainer's
    handler takes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, log: EngineLog, what: str,
                 sigterm: Any = None) -> None:
        """``loop``: the event loop on which the engine registered its own SIGQUIT handler (None: none); install
        after the engine has (SGLang: after its first request); ``what``: the failing process; ``sigterm``: this
        process's SIGTERM handler from before the engine started (None: the one in place), which takes SIGTERM
        between engine calls (SIGHUP: the one in place); the engine loop's own are removed (SGLang's drains
        requests, then SIGKILLs the process tree: a scancel or a Slurm time limit would skip megarl's clean
        interrupt)."""
        self.failed = False
        self.interrupted: int | None = None
        self._calling = False
        self.log, self.what, self.loop = log, what, loop
        if threading.current_thread() is not threading.main_thread():
            print(f"megarl: warning: the engine is driven outside the main thread, where no signal handler can be "
                  f"installed; if {what} fails, the run ends at the engine call's deadline "
                  "(rollout.timeout_minutes) or by the engine's own SIGKILL", flush=True)
            return
        if loop is not None:
            for s in (signal.SIGQUIT, *TERMINATING):
                loop.remove_signal_handler(s)
        self._previous: dict[int, Any] = {s: signal.getsignal(s) for s in TERMINATING}
        if sigterm is not None:
            self._previous[signal.SIGTERM] = sigterm
        signal.signal(signal.SIGQUIT, self._signalled)
        for s in TERMINATING:
            signal.signal(s, self._terminated)

    def _terminated(self, signum: int, frame: Any) -> None:
        if not self._calling:
            previous = self._previous[signum]
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)  # no handler of its own before the engine: the default
                os.kill(os.getpid(), signum)
            return
        self.interrupted = signum
        if self.loop is not None and self.loop.is_running():
            self.loop.stop()
        raise Interrupted(signum)

    def _signalled(self, signum: int, frame: object) -> None:
        self.failed = True
        if self._calling:
            if self.loop is not None and self.loop.is_running():
                self.loop.stop()
            raise EngineProcessDied(f"{self.what} failed (SIGQUIT)")

    @contextmanager
    def alive(self) -> Iterator[None]:
        """Around every call into the engine (an engine that failed between calls fails the next one)."""
        if self.interrupted is not None:
            raise Interrupted(self.interrupted)
        if self.failed:
            raise self._death()
        try:
            self._calling = True
            try:
                yield
            finally:
                self._calling = False
        except BaseException as err:  # the handlers' exceptions may also surface from the line above
            if self.interrupted is not None:
                raise Interrupted(self.interrupted) from None
            if self.failed and isinstance(err, Exception):
                raise self._death() from err
            raise
        if self.interrupted is not None:
            raise Interrupted(self.interrupted)
        if self.failed:
            raise self._death()

    def _death(self) -> RuntimeError:
        self.log.drain()
        return RuntimeError(f"{self.what} failed and signalled this one (SIGQUIT). Engine log: "
                            f"{self.log.summary()[-1500:]}")
