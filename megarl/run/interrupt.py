"""Clean interrupts: SIGINT (Ctrl-C), SIGTERM (scancel, a time limit without --signal) and SIGHUP (the terminal
or ssh session closed) end a run with one line and exit code 128 + the signal; the mlflow run is marked KILLED,
the engine is shut down, and a checkpoint being written is abandoned, never left half-written.

``install()`` turns these signals into ``Interrupted`` in the main thread; ``at_interrupt`` registers what
runs before the process exits (megarl.run.command.run_main calls ``handle``).
"""

from __future__ import annotations

import _thread
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from types import FrameType
from typing import NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that interrupt a run."""
TERMINAL = (signal.SIGINT, signal.SIGHUP)
"""What a terminal sends its whole foreground process group (Ctrl-C, hangup): engine processes ignore them."""

_cleanups: list[Callable[[], object]] = []
_held = 0
"""How many ``deferred`` blocks the main thread is in."""
_pending: list[int] = []
"""The signal that arrived in them, raised when the outermost one ends."""


class Interrupted(BaseException):
    """Raised in the main thread by SIGINT, SIGTERM or SIGHUP (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_handling: list[int] = []
"""Set once ``handle`` runs: a signal that comes in before it has ignored them all (srun's and torchrun's SIGTERM
arrive together) must not interrupt the clean-up with a traceback."""


def _raise(signum: int, frame: FrameType | None) -> None:
    if _handling:
        return
    if _held and not _pending:
        _pending.append(signum)
        return
    raise Interrupted(signum)


@contextmanager
def deferred() -> Iterator[None]:
    """A signal that arrives in the block interrupts the run once the block has ended: a write it makes completes
    first. A step's metrics interrupted inside mlflow's SQLite transaction left the store locked (mlflow rolls back
    on an Exception, not on Interrupted), so the clean-up could not mark the run KILLED: it waited 20 s, printed a
    traceback and left the run RUNNING. A second signal in the block interrupts at once (a store that hangs).
    Outside the main thread, where no signal handler runs, the block is an ordinary one."""
    global _held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        signum = _pending.pop() if not _held and _pending else None
    if signum is not None:
        raise Interrupted(signum)


def install() -> None:
    for s in SIGNALS:
        signal.signal(s, _raise)


def at_interrupt(cleanup: Callable[[], object]) -> None:
    """Run ``cleanup`` (last registered first) when the run is interrupted."""
    _cleanups.append(cleanup)


def handle(stop: Interrupted | KeyboardInterrupt) -> NoReturn:
    """Clean up, say so in one line, exit with 128 + the signal."""
    signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
    _handling.append(signum)
    for s in SIGNALS:  # a second Ctrl-C does not interrupt the clean-up
        signal.signal(s, signal.SIG_IGN)
    for cleanup in reversed(_cleanups):
        try:
            cleanup()
        except Exception as err:  # the exit must not turn into a traceback; say what failed, briefly
            print(f"megarl: clean-up after the interrupt failed: {type(err).__name__}: {err}", file=sys.stderr)
    print(f"megarl: interrupted by {signal.Signals(signum).name}; the newest complete checkpoint resumes with "
          "checkpoint.resume: auto", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


@contextmanager
def terminal_signals_kept_from_children() -> Iterator[None]:
    """Processes started in the block (engine workers) never act on SIGINT and SIGHUP, which Ctrl-C and a closed
    terminal send to the whole terminal: the trainer shuts them down itself instead of each printing its own
    traceback (and megarl.rollout.watchdog kills them if the trainer dies first). The trainer itself still stops.

    The signals are blocked, not ignored, in the main thread while the block runs: children it starts (forked
    or executed) inherit the blocked mask and keep the signals pending forever. Ignoring them here, as before,
    made a Ctrl-C during the engine's start-up vanish: the run trained on to the end. The kernel hands a signal
    the main thread blocks to another thread: one that does not block it runs Python's C handler, which marks it
    for the main thread and writes its number to the wakeup file descriptor; if every thread blocks it, it waits
    for ``sigtimedwait``. A thread of ours watches both and wakes the main thread with a signal of its own, so
    the handler runs at once, whatever system call the main thread waits in. Call it from the main thread, as
    signal handlers are."""
    done, main = threading.Event(), threading.main_thread().ident
    assert main is not None
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def forward() -> None:  # started below, so it inherits the blocked mask and may wait for the signals
        while not done.is_set():
            got = signal.sigtimedwait(TERMINAL, 0)
            if got is not None:
                _thread.interrupt_main(signal.Signals(got.si_signo))
                signal.pthread_kill(main, _WAKE)
            elif select.select([wake_r], [], [], 0.05)[0]:
                numbers = os.read(wake_r, 512)
                if previous_fd >= 0:  # an event loop's own wakeup descriptor: it gets them as before
                    with suppress(OSError):
                        os.write(previous_fd, numbers)
                if any(n in TERMINAL for n in numbers):
                    signal.pthread_kill(main, _WAKE)

    previous_wake = signal.signal(_WAKE, lambda signum, frame: None)  # a handler, so that it ends system calls
    previous_fd = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL)
    forwarder = threading.Thread(target=forward, name="megarl-terminal-signals", daemon=True)
    try:
        forwarder.start()
        yield
    finally:
        done.set()
        forwarder.join()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL)  # one still pending is taken here
        signal.set_wakeup_fd(previous_fd)
        signal.signal(_WAKE, previous_wake)
        os.close(wake_r)
        os.close(wake_w)


_WAKE = signal.SIGRTMIN + 5
"""Sent to the main thread only by the forwarder above, to end the system call it blocks in; no one else uses it
(glibc reserves the real-time signals below SIGRTMIN)."""
