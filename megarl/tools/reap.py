"""What a call leaves on the host, cleaned up whatever the code did: its descriptors (each closed exactly once),
the processes of an unisolated call (found by group and by a marker in their environment) and its working
directory (any depth, any permissions, symlinks never followed)."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from pathlib import Path

MARKER = "MEGARL_SANDBOX_ID"
"""Environment variable set to a per-call id in an unisolated call's processes; the host finds them by it."""


class Descriptors:
    """The descriptors one call owns. Each is closed exactly once: closing a number twice would close whatever
    another thread of the trainer opened under it in between (an engine socket, a checkpoint file)."""

    def __init__(self) -> None:
        self._open: set[int] = set()

    def own(self, fd: int) -> int:
        self._open.add(fd)
        return fd

    def pipe(self) -> tuple[int, int]:
        r, w = os.pipe()
        return self.own(r), self.own(w)

    def close(self, fd: int) -> None:
        if fd in self._open:
            self._open.remove(fd)  # first: even if close fails, the number is never closed again
            os.close(fd)

    def close_all(self) -> None:
        for fd in sorted(self._open):
            with contextlib.suppress(OSError):
                self.close(fd)


def marked_pids(call_id: str) -> list[int]:
    """Live processes whose environment carries this call's marker (zombies have an empty environment)."""
    needle = f"{MARKER}={call_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def reap_unisolated(pgid: int, call_id: str, deadline: float) -> list[int]:
    """SIGKILL the call's process group and every marked process until none is left; the pids still alive at
    the deadline. A process that cleared its environment and left the group escapes this: the unisolated mode
    holds nothing against hostile code (docs/tools.md)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    while left := marked_pids(call_id):
        if time.monotonic() > deadline:
            return left
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return []


def remove_tree(path: str) -> None:
    """Remove `path` and everything below it, whatever its depth and permissions; never follows a symlink.

    Iterative, so depth costs no recursion; one directory descriptor open at a time (a parent is reopened
    through ".."), so depth costs no descriptors either; directories are made searchable and writable before
    they are read, so a `chmod 000` one is removed too (by its owner or root). Raises OSError only if something
    stays (e.g. a mount point), naming it.
    """
    names: list[str] = []  # the path from `path` down to the directory `fd` is open on
    if stat.S_ISDIR(os.lstat(path).st_mode):
        os.chmod(path, stat.S_IRWXU)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        while True:
            child = _first_entry(fd)
            if child is not None:
                name, is_dir = child
                if not is_dir:
                    os.unlink(name, dir_fd=fd)
                    continue
                os.chmod(name, stat.S_IRWXU, dir_fd=fd)  # a directory (is_dir did not follow links)
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = sub
                names.append(name)
                continue
            if not names:
                break
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = parent
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _first_entry(dir_fd: int) -> tuple[str, bool] | None:
    """One entry of the directory (name, is a real directory), or None when it is empty."""
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            return entry.name, entry.is_dir(follow_symlinks=False)
    return None
