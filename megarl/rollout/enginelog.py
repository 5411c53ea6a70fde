"""Where a rollout engine's output goes: a file per engine in the run directory, not the console.

Engines run in child processes (vLLM's EngineCore and workers, SGLang's schedulers) that inherit this
process's stdout and stderr when they start. ``EngineLog.capture`` points file descriptors 1 and 2 into
pipes for the duration of the engine's start; threads pump what arrives into the engine's log file (or
the console, without one) and keep the last lines, so that a failed start can name its root cause. After
the start this process writes to the console again while the engine's processes keep writing into the
pipes; the engine's loggers in this process are pointed at the file too.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENGINE_LOGGERS = ("vllm", "sglang")
"""Loggers of the engines' code that runs in this process (vLLM's LLM front end, SGLang's tokenizer manager)."""


_consoles: list[int] = []
"""This process's own stderr while engine starts redirect fd 2 (innermost last)."""


def console() -> int:
    """The file descriptor of this process's stderr, also while an engine's start redirects fd 2 to its log."""
    return _consoles[-1] if _consoles else 2


_moved: weakref.WeakSet[logging.StreamHandler] = weakref.WeakSet()
"""Handlers an engine's log has pointed at its file: the engines' console handlers, and those it added."""


def _ours_to_move(handler: logging.StreamHandler) -> bool:
    """Whether ``handler`` writes to this process's console, or into an earlier engine's log."""
    if handler in _moved:
        return True
    if isinstance(handler, logging.FileHandler):
        return False
    try:
        return handler.stream.fileno() in (1, 2)
    except (AttributeError, OSError, ValueError):  # a StringIO's fileno raises io.UnsupportedOperation (an OSError)
        return False


class EngineLog:
    """One engine's log: ``path`` (appended to), or this process's console when None."""

    def __init__(self, path: Path | None = None, lines: int = 400) -> None:
        self.path = path
        self.lines: deque[str] = deque(maxlen=lines)
        self._last = time.monotonic()

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Send everything written to fds 1 and 2 while the block runs (and later by processes started in it)
        to the log."""
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)  # the run directory may not exist yet
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        sink = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if self.path else None
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            read, write = os.pipe()
            os.dup2(write, fd)  # inheritable: the engine processes write into the pipe
            os.close(write)
            out = os.dup(sink if sink is not None else saved[fd])
            threading.Thread(target=self._pump, args=(read, out), daemon=True).start()
        _consoles.append(saved[2])
        try:
            yield
        finally:
            _consoles.remove(saved[2])
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, fd_saved in saved.items():
                os.dup2(fd_saved, fd)
                os.close(fd_saved)
            if sink is not None:
                self._redirect_loggers()
                os.close(sink)

    def _pump(self, read: int, out: int) -> None:
        # Runs until every process holding a copy of the pipe has exited.
        with os.fdopen(read, "rb", buffering=0) as pipe:
            for line in iter(pipe.readline, b""):
                os.write(out, line)
                self.lines.append(line.decode(errors="replace").rstrip())
                self._last = time.monotonic()
        os.close(out)

    def _redirect_loggers(self) -> None:
        """vLLM's logger has console handlers of its own; SGLang's propagates to the root logger's. Only handlers
        that write to this process's stdout or stderr are pointed at the file: one writing elsewhere (a test
        runner's capture, a user's own file) is not ours to move."""
        assert self.path is not None
        stream = open(self.path, "a", buffering=1)  # noqa: SIM115 (lives as long as the engine's loggers)
        earlier: set[Any] = set()
        for name in ENGINE_LOGGERS:
            if name not in logging.root.manager.loggerDict:
                continue
            logger = logging.getLogger(name)
            consoles = [h for h in logger.handlers if isinstance(h, logging.StreamHandler) and _ours_to_move(h)]
            for handler in consoles:
                old = handler.setStream(stream)
                if handler in _moved and old is not None:
                    earlier.add(old)
                _moved.add(handler)
            if not consoles:
                handler = logging.StreamHandler(stream)
                handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
                logger.addHandler(handler)
                logger.propagate = False
                _moved.add(handler)
        for old in earlier:  # after every move: the loggers may share one
            old.close()

    def drain(self, quiet: float = 1.0, timeout: float = 10.0) -> None:
        """After a failed start: wait until the log has been quiet for ``quiet`` seconds, so that the dying
        engine processes' last lines are read. (The pipes may never close: helper processes such as
        multiprocessing's resource tracker inherit them and live as long as this process.)"""
        deadline = time.monotonic() + timeout
        while time.monotonic() < min(deadline, self._last + quiet):
            time.sleep(0.05)

    def summary(self) -> str:
        """The first exception lines (``SomeError: message``) of the log, where the root cause usually is,
        skipping warnings (vLLM logs a harmless chat-template traceback without a tokenizer); else its end."""
        found: list[str] = []
        for line in list(self.lines):  # a snapshot: the pumps keep appending
            match = re.search(r"\b(\w*(?:Error|Exception): .*)", line)
            if match and not re.search(r"\) (WARNING|INFO|DEBUG) ", line) and match.group(1) not in found:
                found.append(match.group(1))
        text = " | ".join(found[:3] if found else list(self.lines)[-8:])
        return text + (f" (full log: {self.path})" if self.path else "")
