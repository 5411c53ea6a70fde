"""One run per run directory: rank 0 holds an exclusive ``flock`` on ``run.lock`` there for as long as it lives.

Two runs in one directory would resume from each other's checkpoints mid-write, overwrite each other's saves
and log the same steps twice. The kernel drops the lock when its holder exits, however it exits (kill -9
included), so a stale lock never blocks a rerun; the file stays behind and only says who held it last (it is
never deleted: a run that opened the old file and one that created a new one would both hold "the" lock).

Filesystems: local ones exactly; NFS through the client's emulation of flock by POSIX locks (NFSv4: a crashed
node's lock expires with its lease, about 90 s; NFSv3: when the node's lock daemon comes back); Lustre when
mounted with ``-o flock`` (``localflock`` keeps locks within one node, so two nodes would not see each other's).
A filesystem without locks fails the run with an error that names the directory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.errors import UserError

if TYPE_CHECKING:
    import torch

LOCK_FILE = "run.lock"

_held: list[int] = []
"""Descriptors of the locks this process holds (kept open for its lifetime)."""
_held_paths: set[Path] = set()


def _close_in_child() -> None:
    # A forked engine process would keep the lock (it shares the open file) after the trainer died.
    for fd in _held:
        os.close(fd)
    _held.clear()
    _held_paths.clear()


os.register_at_fork(after_in_child=_close_in_child)


def holder_text() -> str:
    """What the lock file says about its holder: this process, this host, now."""
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n"


def acquire(directory: Path, field: str = "checkpoint.dir") -> Path:
    """Lock ``directory`` for this process's lifetime; its lock file. Refused (UserError) while another process
    holds it, naming that process's pid, host and start time."""
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise UserError(f"{field} = {str(directory)!r}: the run lock {str(path)!r} cannot be opened "
                        f"({err.strerror or err}). Fix: point {field} at a writable directory.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            who = holder or "a process that has not yet written its pid (it is starting)"
            raise UserError(f"{field} = {str(directory)!r} is in use by another megarl run: {who} (lock "
                            f"{str(path)!r}). A second run there would resume from the first's unfinished "
                            f"checkpoints and overwrite its saves and metrics. Fix: wait for that run to end or "
                            f"stop it, or set {field} to another directory.") from None
        raise UserError(f"{field} = {str(directory)!r}: its filesystem does not support file locks "
                        f"({err.strerror or err}), which keep a second run out of the directory. Fix: put {field} "
                        "on a filesystem with locks (local disk, NFS with its lock service, Lustre mounted "
                        "with -o flock).") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder_text().encode(), 0)
    os.fsync(fd)
    _held.append(fd)
    _held_paths.add(path.resolve())
    return path


def held_by_another(directory: Path) -> bool:
    """Whether another live process holds ``directory``'s run lock (a run that must not touch what is there)."""
    path = directory / LOCK_FILE
    if path.resolve() in _held_paths:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: no run has held it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        return err.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # drops the shared lock, if taken
    return False


def lock_run(directory: Path, field: str, device: torch.device) -> None:
    """Rank 0 locks the run directory; every rank learns whether it could, and a refused run stops on every
    rank with exit code 2 (rank 0 names the holder) instead of leaving the others waiting for it."""
    import torch
    import torch.distributed as dist

    refused: UserError | None = None
    if dist.get_rank() == 0:
        try:
            acquire(directory, field)
        except UserError as err:
            refused = err
    flag = torch.tensor([refused is not None], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    if refused is not None:
        raise refused
    if flag.item():
        raise UserError(f"rank 0 could not lock {field} = {str(directory)!r}; its message says why.")
