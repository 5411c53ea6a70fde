"""Run model-written Python in a sandbox and say how it ended.

The sandbox is bubblewrap (bwrap.py: namespaces, a minimal read-only root, tmpfs, seccomp, nobody), a cgroup per
call where the machine has one (cgroups.py: memory, processes and CPU over the whole call) and rlimits per process
(sandbox_init.py). A machine that cannot run it is refused when the tool is built (`require_isolation`), unless
the user names `isolation: unsafe-none`, which runs the code as the trainer's user with rlimits only. Whatever
the code does, the call ends with all its processes killed and nothing of it left on the host (reap.py).
docs/tools.md says what holds where.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megarl.config.yaml_io import check
from megarl.errors import UserError
from megarl.tools import bwrap, seccomp
from megarl.tools.cgroups import CallCgroup
from megarl.tools.reap import MARKER, Descriptors, reap_unisolated, remove_tree

_SCRIPT = "main.py"
_CPU_SLACK_S = 0.5
"""How far below its limit (cpu_s for SIGXCPU, cpu_s + 1 for SIGKILL) a process's CPU time may read for the signal
to count as the limit's: the kernel stops it there with its CPU time reading up to a few tenths of a second short
(measured); further below, the signal is the code's own (or the OOM killer's)."""
_CLEANUP_S = 5.0
"""How long killing a call's processes may take before the survivors are reported."""


@dataclass(kw_only=True, slots=True)
class SandboxConfig:
    timeout_s: float = 10.0
    """Wall-clock seconds a call may take; then everything it started is killed."""
    cpu_s: int = 10
    """CPU seconds each process of the call may use (RLIMIT_CPU)."""
    cpus: float = 1.0
    """CPUs the whole call may use at once (its cgroup's CPU quota, where there is one)."""
    memory_bytes: int = 1 << 30
    """Memory of the whole call, its tmpfs included (its cgroup, where there is one), and address space of each
    process (RLIMIT_AS); beyond it allocations fail with MemoryError or the kernel kills the call."""
    disk_bytes: int = 64 << 20
    """Size of each of the call's private tmpfs: its working directory, /tmp and /dev/shm (bwrap only)."""
    output_bytes: int = 4096
    """Bytes of stdout+stderr kept; the rest is dropped and a marker says how much."""
    file_bytes: int = 16 << 20
    """Largest file the code may write (RLIMIT_FSIZE)."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_processes: int = 32
    """Processes and threads of the call together (its cgroup's pids.max, and RLIMIT_NPROC: docs/tools.md)."""
    python: str = sys.executable
    """Interpreter that runs the code, started with -I (isolated: no PYTHON* variables, no user site) and -u
    (unbuffered, so stdout and stderr interleave as written and nothing printed before a kill is lost)."""
    isolation: Literal["bwrap", "unsafe-none"] = "bwrap"
    """bwrap: the sandbox of docs/tools.md; a machine that cannot run it is refused when the tool is built.
    unsafe-none: the code runs as the trainer's user, on the host's files, with rlimits only: no protection
    against hostile code, for code you would run yourself (a warning says so)."""
    temp_root: str | None = None
    """Where unsafe-none makes the per-call working directories; None = the system's temporary directory."""
    host_uid: int | None = None
    """A root trainer's calls run as this host uid and gid instead (bwrap only), which owns their user namespaces,
    so what the kernel counts per user is counted against it, not root (docs/tools.md). Best a uid nothing else
    uses; it must be able to read the interpreter, its prefixes and megarl/tools/sandbox_init.py (a pyenv or uv
    Python under /root it cannot). None: root's namespaces, with what would drain root's quotas removed."""

    def __post_init__(self) -> None:
        check(0 < self.timeout_s < math.inf, "timeout_s", self.timeout_s, "be > 0 and finite", "use e.g. 10")
        check(0 < self.cpus < math.inf, "cpus", self.cpus, "be > 0 and finite", "use e.g. 1")
        for name, low in (("cpu_s", 1), ("memory_bytes", 64 << 20), ("disk_bytes", 1 << 20), ("output_bytes", 64),
                          ("file_bytes", 0), ("open_files", 16), ("max_processes", 4)):
            value = getattr(self, name)
            check(value >= low, name, value, f"be >= {low}", f"raise `{name}` to at least {low}")
        check(self.isolation in ("bwrap", "unsafe-none"), "isolation", self.isolation, "be bwrap or unsafe-none",
              "use bwrap (unsafe-none only for code you trust)")
        check(os.access(self.python, os.X_OK), "python", self.python, "be an executable interpreter",
              "use sys.executable or the path of a python3 binary")
        check(self.host_uid is None or 0 < self.host_uid < (1 << 32) - 1, "host_uid", self.host_uid,
              "be an unprivileged uid (> 0) or null", "use a uid of the sandbox's own, or null")


@dataclass(kw_only=True, slots=True)
class SandboxResult:
    output: str
    """stdout and stderr interleaved, truncated to output_bytes."""
    end: str
    """Why the call ended, as the host saw it: "ok", "exit code N", "timeout after N s", "killed: memory limit"
    (the call's cgroup killed a process), "killed: CPU time limit" (the script's process was stopped at cpu_s),
    "killed by signal SIGX", "sandbox failed: ..."."""
    truncated_bytes: int = 0
    """Output bytes dropped."""
    layers: dict[str, str] = field(default_factory=dict)
    """What confined the call, as the host set it up (never as the call reports it)."""
    survivors: list[int] = field(default_factory=list)
    """Processes of the call still alive after killing them (should be empty; a non-empty list is a bug)."""

    @property
    def observation(self) -> str:
        """What the model sees: the output, the truncation marker, and the end unless it was "ok"."""
        parts = [self.output.rstrip("\n")]
        if self.truncated_bytes:
            parts.append(f"... [output truncated: {self.truncated_bytes} more bytes]")
        if self.end != "ok":
            parts.append(f"[{self.end}]")
        return "\n".join(part for part in parts if part) or "(no output)"


def require_isolation(config: SandboxConfig) -> None:
    """Refuse (UserError: one paragraph, exit 2) a machine where the sandbox cannot run; warn for unsafe-none."""
    if config.isolation == "unsafe-none":
        warnings.warn("the Python tool runs with isolation: unsafe-none: model-written code runs as the trainer's "
                      "user with rlimits only, and can read and change anything that user can. Use it only for "
                      "code you would run yourself.", stacklevel=2)
        return
    problem = _isolation_problem(config.python, config.host_uid)
    if problem:
        raise UserError(
            f"The Python tool cannot isolate model-written code on this machine: {problem}. It needs bubblewrap "
            "(bwrap) and user namespaces. Fix: install bubblewrap (as root: apt-get install bubblewrap, which "
            "scripts/bootstrap.sh does), and allow user namespaces (sysctl user.max_user_namespaces=10000; on "
            "Debian kernel.unprivileged_userns_clone=1; on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0); "
            "with `host_uid` set, let that uid read the interpreter, its prefixes and megarl/tools/sandbox_init.py, "
            "or unset it. Only for code you trust: set the tool's `isolation: unsafe-none` (agent.tools[].args).")


@functools.cache
def _isolation_problem(python: str, host_uid: int | None) -> str | None:
    """Why a sandboxed call cannot run here, or None: one real call, checked from inside."""
    if not seccomp.supported():
        return f"no seccomp filter for this machine's architecture ({os.uname().machine}; x86_64 and aarch64 are)"
    if bwrap.executable() is None:
        return "bwrap is not installed"
    probe = ("import os\n"
             "print(os.getuid(), [l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp:')])")
    result = run_python(probe, SandboxConfig(python=python, timeout_s=30.0, host_uid=host_uid))
    if result.end != "ok" or result.output.split() != [str(bwrap.UID), "['2']"]:
        return f"a test call ended with {result.end!r} and printed {result.output.strip()[-300:]!r}"
    return None


def run_python(code: str, config: SandboxConfig) -> SandboxResult:
    """Run `code` as a script in the sandbox; never raises for anything the code does."""
    if config.isolation == "unsafe-none":
        return _run_unisolated(code, config)
    return _run_bwrap(code, config)


def _init_spec(config: SandboxConfig, drop_to: int | None, report_fd: int) -> dict:
    return {"script": _SCRIPT, "uid": drop_to, "report_fd": report_fd, "cpu_s": config.cpu_s,
            "memory_bytes": config.memory_bytes, "file_bytes": config.file_bytes, "open_files": config.open_files,
            "max_processes": config.max_processes}


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_bwrap(code: str, config: SandboxConfig) -> SandboxResult:
    # bwrap run by root makes root's user namespaces, which the host maps (bwrap.py); run as host_uid, its own
    user = config.host_uid if os.geteuid() == 0 else None
    as_root = os.geteuid() == 0 and user is None
    deadline = time.monotonic() + config.timeout_s
    # named after this process too: a check for leftovers (tests/test_sandbox_attacks.py) sees only its own calls'
    cgroup = CallCgroup.create(f"{os.getpid()}-{uuid.uuid4().hex}", config.memory_bytes, config.max_processes,
                               config.cpus)
    layers = {"sandbox": "bwrap: user, ipc, uts, pid, mount, network and cgroup namespaces; read-only /usr and "
                         "interpreter; private /proc, minimal /dev, tmpfs workdir, /tmp and /dev/shm",
              "seccomp": "denies namespaces, mount, ptrace, keyctl, bpf, perf_event_open and more; sockets "
                         "AF_UNIX only",
              "uid": f"{bwrap.UID} (nobody), no capabilities; on the host "
                     f"{bwrap.UID if as_root else user or os.geteuid()}",
              "limits": (cgroup.describe() if cgroup else "none per call") + " + rlimits per process"}
    fds = Descriptors()
    try:
        fd = {"code": fds.own(_memfd("code", code.encode("utf-8", "surrogateescape"))),
              "seccomp": fds.own(_memfd("seccomp", seccomp.program()))}
        info_r, fd["info"] = fds.pipe()
        fd["block"], block_w = fds.pipe()
        report_r, fd["report"] = fds.pipe()
        spec = _init_spec(config, bwrap.UID if as_root else None, fd["report"])
        argv = bwrap.command(config.python, config.disk_bytes, spec, as_root=as_root, fds=fd)
        try:
            proc = subprocess.Popen(argv, pass_fds=list(fd.values()), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={"PATH": "/usr/bin:/bin"}, cwd="/", user=user, group=user,
                                    extra_groups=None if user is None else [])
        except OSError as err:
            return SandboxResult(output="", end=f"sandbox failed: {err}", layers=layers)
        for name in fd:  # bwrap's ends, now its own
            fds.close(fd[name])
        with proc:
            start_error = ""
            try:
                child = _child_pid(info_r, deadline)
                pidfd = fds.own(os.pidfd_open(child))
                if as_root:
                    bwrap.write_maps(child)
                if cgroup:  # before the child forks anything: what it starts is born in the cgroup
                    cgroup.join(proc.pid)
                    cgroup.join(child)
                os.write(block_w, b"1")
                fds.close(block_w)
                kept, dropped, timed_out = _collect(proc, deadline, config.output_bytes)
                # bwrap's child is the PID namespace's init: every process of the call dies with it. bwrap then
                # reaps it and exits: killed before that, it left the init to the trainer's reaper as a zombie (one
                # a timed-out call; never collected where the trainer is its container's PID 1).
                _signal(signal.pidfd_send_signal, pidfd, signal.SIGKILL)
                try:
                    proc.wait(timeout=_CLEANUP_S)
                except subprocess.TimeoutExpired:
                    pass
            except (OSError, ValueError) as err:
                start_error = f"sandbox failed: {err}"
                # bwrap may have said why before it exited (a bind source it cannot read): kill it, keep that
                _signal(os.killpg, proc.pid, signal.SIGKILL)
                kept, dropped, timed_out = _collect(proc, time.monotonic() + _CLEANUP_S, config.output_bytes)
            _signal(os.killpg, proc.pid, signal.SIGKILL)
            survivors = cgroup.kill(time.monotonic() + _CLEANUP_S) if cgroup else []
            proc.wait()
        end = start_error or _end(_report(report_r), timed_out, cgroup is not None and cgroup.oom_killed(), config)
    finally:
        fds.close_all()
        if cgroup:
            cgroup.remove()
    return SandboxResult(output=kept.decode("utf-8", "replace"), truncated_bytes=dropped, layers=layers, end=end,
                         survivors=survivors)


def _signal(send: Callable[[int, int], None], target: int, sig: int) -> None:
    """Send `sig` unless the target is gone already."""
    try:
        send(target, sig)
    except ProcessLookupError:
        pass


def _child_pid(info: int, deadline: float) -> int:
    """The pid of bwrap's child, from the JSON bwrap writes to its info fd (until EOF) before the call starts."""
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(info, selectors.EVENT_READ)
        while True:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                raise ValueError("bwrap did not start in time")
            chunk = os.read(info, 4096)
            if not chunk:
                break
            data += chunk
    try:
        parsed = json.loads(data)
    except ValueError:
        raise ValueError(f"bwrap exited before starting the call ({data[:200]!r})") from None
    pid = parsed.get("child-pid") if isinstance(parsed, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        raise ValueError(f"bwrap's start-up report has no child pid: {data[:200]!r}")
    return pid


def _run_unisolated(code: str, config: SandboxConfig) -> SandboxResult:
    call_id = uuid.uuid4().hex
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="megarl-sandbox-", dir=config.temp_root))
    deadline = time.monotonic() + config.timeout_s
    fds = Descriptors()
    try:
        Path(workdir, _SCRIPT).write_text(code, errors="surrogateescape")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               MARKER: call_id}
        init = str(Path(__file__).with_name("sandbox_init.py"))
        report_r, report_w = fds.pipe()
        proc = subprocess.Popen([config.python, "-I", "-u", init, json.dumps(_init_spec(config, None, report_w))],
                                cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=[report_w])
        fds.close(report_w)
        with proc:
            kept, dropped, timed_out = _collect(proc, deadline, config.output_bytes)
            survivors = reap_unisolated(proc.pid, call_id, time.monotonic() + _CLEANUP_S)
            proc.wait()
        end = _end(_report(report_r), timed_out, False, config)
    finally:
        fds.close_all()
        remove_tree(workdir)
    return SandboxResult(output=kept.decode("utf-8", "replace"), truncated_bytes=dropped,
                         layers={"sandbox": "none (unsafe-none)", "limits": "rlimits per process"},
                         end=end, survivors=survivors)


def _report(read_end: int) -> dict:
    """What sandbox_init.py reported of the script's end; {} if it ended before reporting. Read once everything
    that held the pipe is dead: the report, far below PIPE_BUF, is written at once or not at all."""
    os.set_blocking(read_end, False)
    try:
        report = json.loads(os.read(read_end, 4096))
    except (BlockingIOError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def _end(report: dict, timed_out: bool, oom_killed: bool, config: SandboxConfig) -> str:
    """How the call ended, from the host's deadline, its cgroup's counters and the init's report: never from the
    code's exit status alone, which the code chooses (86 once read as the memory limit, 152 as the CPU's)."""
    if timed_out:
        return f"timeout after {config.timeout_s:g} s"
    if oom_killed:
        return "killed: memory limit"
    if isinstance(report.get("exit"), int):
        return "ok" if report["exit"] == 0 else f"exit code {report['exit']}"
    sig, cpu_s = report.get("signal"), report.get("cpu_s")
    if not isinstance(sig, int) or not isinstance(cpu_s, int | float):
        return "sandbox failed: the call ended before its init reported how"
    # the kernel's SIGXCPU at RLIMIT_CPU, or its SIGKILL at the hard limit a second later (each read up to a few
    # tenths of a second short); the same signal sooner is the code's own, or the kernel's OOM killer's
    limit = config.cpu_s if sig == signal.SIGXCPU else config.cpu_s + 1
    if sig in (signal.SIGXCPU, signal.SIGKILL) and cpu_s >= limit - _CPU_SLACK_S:
        return "killed: CPU time limit"
    try:
        return f"killed by signal {signal.Signals(sig).name}"
    except ValueError:
        return f"killed by signal {sig}"


def _collect(proc: subprocess.Popen, deadline: float, limit: int) -> tuple[bytearray, int, bool]:
    """Read output until the launcher exits or the deadline passes; keep `limit` bytes. Not until EOF: a
    background process holding the pipe would keep it open."""
    assert proc.stdout is not None
    kept, dropped = bytearray(), 0
    out = proc.stdout.fileno()
    os.set_blocking(out, False)
    exited = os.pidfd_open(proc.pid)
    timed_out, reading, done = False, True, False
    with selectors.DefaultSelector() as sel, _closing(exited):
        sel.register(out, selectors.EVENT_READ)
        sel.register(exited, selectors.EVENT_READ)
        while not done:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready = {key.fd for key, _ in sel.select(left)}
            done = exited in ready
            while reading and (out in ready or done):  # after the exit, drain what is already in the pipe
                try:
                    chunk = os.read(out, 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    sel.unregister(out)
                    reading = False
                room = max(0, limit - len(kept))
                kept += chunk[:room]
                dropped += len(chunk) - min(room, len(chunk))
    return kept, dropped, timed_out


@contextlib.contextmanager
def _closing(fd: int) -> Iterator[None]:
    try:
        yield
    finally:
        os.close(fd)
