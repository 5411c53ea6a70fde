"""Ending everything a sandboxed call started: its process group, its pids cgroup, and any process still carrying
the call's marker in its environment (one that left the group with setsid and has no namespace to die with)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

MARKER = "MEGARL_SANDBOX_ID"
"""Environment variable set to a per-call id in every sandboxed process; it lets the host find them in /proc."""

_PIDS_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))


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


def make_pids_cgroup(call_id: str, max_processes: int) -> Path | None:
    """A pids cgroup (v1, or v2 where the pids controller is enabled) limited to `max_processes` tasks, or None
    where we may not create one."""
    for root in _PIDS_ROOTS:
        if root == Path("/sys/fs/cgroup") and "pids" not in _read(root / "cgroup.subtree_control"):
            continue
        group = root / f"megarl-sandbox-{call_id}"
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / "pids.max").write_text(str(max_processes))
        except OSError:
            group.rmdir()
            continue
        return group
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reap(pgid: int, call_id: str, cgroup: Path | None, deadline_s: float = 5.0) -> list[int]:
    """SIGKILL the group, the cgroup's members and every marked process until none is left (a fork bomb keeps
    forking while we kill); remove the cgroup. Returns the pids still alive at the deadline (none, normally)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    end = time.monotonic() + deadline_s
    while True:
        members = [int(p) for p in _read(cgroup / "cgroup.procs").split()] if cgroup else []
        left = sorted(set(members) | set(marked_pids(call_id)))
        if not left:
            break
        if time.monotonic() > end:
            return left
        for pid in left:
            _kill(pid)
        time.sleep(0.01)
    if cgroup:
        # the last members may still be exiting (zombies count until reaped); rmdir succeeds once they are gone
        while time.monotonic() < end:
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.01)
    return []
