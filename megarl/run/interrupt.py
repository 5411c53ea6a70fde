"""Clean interrupts: SIGINT (Ctrl-C), SIGTERM (scancel, a time limit without --signal) and SIGHUP (the terminal
or ssh session closed) end a run with one line and exit code 128 + the signal; the mlflow run is marked KILLED,
the engine is shut down, and a checkpoint being written is abandoned, never left half-written.

``install()`` turns these signals into ``Interrupted`` in the main thread; ``at_interrupt`` registers what
runs before the process exits (megarl.run.command.run_main calls ``handle``).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that interrupt a run."""
TERMINAL = (signal.SIGINT, signal.SIGHUP)
"""What a terminal sends its whole foreground process group (Ctrl-C, hangup): engine processes ignore them."""

_cleanups: list[Callable[[], object]] = []


class Interrupted(BaseException):
    """Raised in the main thread by SIGINT, SIGTERM or SIGHUP (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame: FrameType | None) -> None:
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
def terminal_signals_ignored() -> Iterator[None]:
    """Processes started in the block (engine workers) ignore SIGINT and SIGHUP, which Ctrl-C and a closed
    terminal send to the whole terminal: the trainer shuts them down itself instead of each printing its own
    traceback (and megarl.rollout.watchdog kills them if the trainer dies first)."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in TERMINAL}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
