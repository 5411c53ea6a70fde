"""A cgroup per sandboxed call: memory (swap included), process count and CPU share limited over the whole
process tree of the call, and a membership list to kill from.

cgroup v2 where our own cgroup delegates the memory and pids controllers to its children (cgroup.subtree_control);
else cgroup v1 where the memory and pids hierarchies are mounted and writable (root). None where neither is
(the sandbox then limits each process with rlimits; docs/tools.md says what that leaves).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

_PERIOD_US = 100_000
_swept = False


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    found = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) > 4 and len(tail) > 2 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[4], tail[0], set(tail[2].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Our cgroup per controller ("" for the v2 hierarchy), from /proc/self/cgroup."""
    paths = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path.lstrip("/")
    return paths


def _parents() -> list[tuple[Path, int]]:
    """The directories our calls' cgroups are made in (our own cgroup, per hierarchy), with the cgroup version."""
    own = _own_paths()
    return [(Path(point, own[c]), 2 if kind == "cgroup2" else 1) for point, kind, options in _mounts()
            for c in ([""] if kind == "cgroup2" else sorted(options & {"memory", "pids", "cpu"})) if c in own]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> int:
    """Kill what is left in the cgroups of calls whose trainer process is gone (killed mid-call: nothing of its
    own removed them) and remove them; how many."""
    removed = 0
    for parent, version in _parents():
        with contextlib.suppress(OSError):
            stale = [d for d in parent.iterdir() if d.name.startswith("megarl-sandbox-")
                     and d.name.split("-")[2].isdigit() and not _alive(int(d.name.split("-")[2]))]
            for d in stale:
                group = CallCgroup({"": d}, version)
                group.kill(time.monotonic() + 2.0)
                group.remove()
                removed += not d.exists()
    return removed


class CallCgroup:
    """The cgroup directories of one call (one under v2; one per controller under v1)."""

    def __init__(self, dirs: dict[str, Path], version: int) -> None:
        self.dirs, self.version = dirs, version

    @classmethod
    def create(cls, call_id: str, memory_bytes: int, max_processes: int, cpus: float) -> CallCgroup | None:
        """A new cgroup with these limits, or None where this process may not make one. The first call of a
        process first clears the cgroups dead trainers left (``sweep_stale``)."""
        global _swept
        if not _swept:
            _swept = True
            sweep_stale()
        for make in (cls._v2, cls._v1):
            group = make(f"megarl-sandbox-{call_id}")
            if group is None:
                continue
            try:
                group._limit(memory_bytes, max_processes, cpus)
            except OSError:
                group.remove()
                continue
            return group
        return None

    @classmethod
    def _v2(cls, name: str) -> CallCgroup | None:
        own = _own_paths().get("")
        for point, kind, _ in _mounts():
            if kind != "cgroup2" or own is None:
                continue
            parent = Path(point, own)
            if not {"memory", "pids"} <= set(_read(parent / "cgroup.subtree_control").split()):
                continue
            with contextlib.suppress(OSError):
                (parent / name).mkdir()
                return cls({"": parent / name}, 2)
        return None

    @classmethod
    def _v1(cls, name: str) -> CallCgroup | None:
        own, dirs = _own_paths(), {}
        for point, kind, options in _mounts():
            for controller in ("memory", "pids", "cpu"):
                if kind == "cgroup" and controller in options and controller in own and controller not in dirs:
                    dirs[controller] = Path(point, own[controller], name)
        if "memory" not in dirs or "pids" not in dirs:
            return None
        group = cls({}, 1)
        for controller, path in dirs.items():
            try:
                path.mkdir()
            except OSError:
                if controller != "cpu":  # the CPU share is a bonus; memory and pids are the point
                    group.remove()
                    return None
                continue
            group.dirs[controller] = path
        return group

    def _limit(self, memory_bytes: int, max_processes: int, cpus: float) -> None:
        quota = max(1000, int(cpus * _PERIOD_US))
        if self.version == 2:
            d = self.dirs[""]
            (d / "memory.max").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):  # absent without swap accounting
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(max_processes))
            with contextlib.suppress(OSError):  # the cpu controller may not be delegated
                (d / "cpu.max").write_text(f"{quota} {_PERIOD_US}")
            return
        memory = self.dirs["memory"]
        (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
        with contextlib.suppress(OSError):  # absent without swap accounting
            (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        (self.dirs["pids"] / "pids.max").write_text(str(max_processes))
        if "cpu" in self.dirs:
            (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))

    def describe(self) -> str:
        limits = "memory, pids" + (", cpu" if self.version == 2 or "cpu" in self.dirs else "")
        return f"cgroup v{self.version} ({limits})"

    def join(self, pid: int) -> None:
        """Move `pid` (not yet forked) into the call's cgroup; its children are born there."""
        for d in self.dirs.values():
            (d / "cgroup.procs").write_text(str(pid))

    def members(self) -> list[int]:
        return sorted({int(p) for d in self.dirs.values() for p in _read(d / "cgroup.procs").split()})

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the call for the memory limit."""
        events = self.dirs[""] / "memory.events" if self.version == 2 else self.dirs["memory"] / "memory.oom_control"
        counts = dict(line.split()[:2] for line in _read(events).splitlines() if len(line.split()) >= 2)
        return counts.get("oom_kill", "0") != "0"

    def kill(self, deadline: float) -> list[int]:
        """SIGKILL every member until none is left (a fork bomb forks while we kill); the pids left at the
        deadline (none, normally)."""
        if self.version == 2:
            with contextlib.suppress(OSError):  # cgroup.kill: Linux >= 5.14
                (self.dirs[""] / "cgroup.kill").write_text("1")
        while members := self.members():
            if time.monotonic() > deadline:
                return members
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        return []

    def remove(self) -> None:
        """Remove the directories; a member still exiting (a zombie not yet reaped) holds one for a moment."""
        end = time.monotonic() + 2.0
        for d in list(self.dirs.values()):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > end:
                        break
                    time.sleep(0.005)
