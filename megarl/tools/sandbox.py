"""Run model-written Python in a confined child process and say how it ended.

Each call gets a fresh working directory, a minimal environment with a per-call marker, closed stdin, its own
session, rlimits and, where the kernel allows, new network/PID/mount namespaces, a pids cgroup and no
capabilities (sandbox_child.py); everything it started is killed when the call ends. See docs/tools.md for
what holds where.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from megarl.config.yaml_io import check
from megarl.tools.reap import MARKER, make_pids_cgroup, reap

_CHILD = str(Path(__file__).with_name("sandbox_child.py"))
_SCRIPT = "main.py"


@dataclass(kw_only=True, slots=True)
class SandboxConfig:
    timeout_s: float = 10.0
    """Wall-clock seconds a call may take; then everything it started is killed."""
    cpu_s: int = 10
    """CPU seconds each process of the call may use (RLIMIT_CPU)."""
    memory_bytes: int = 1 << 30
    """Address space of each process (RLIMIT_AS); allocations beyond it fail with MemoryError."""
    output_bytes: int = 4096
    """Bytes of stdout+stderr kept; the rest is dropped and a marker says how much."""
    file_bytes: int = 16 << 20
    """Largest file the code may write (RLIMIT_FSIZE)."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_processes: int = 32
    """Processes and threads of the call together (a pids cgroup as root, else RLIMIT_NPROC: see docs/tools.md)."""
    python: str = sys.executable
    """Interpreter that runs the code, started with -I (isolated: no PYTHON* variables, no user site) and -u
    (unbuffered, so stdout and stderr interleave as written and nothing printed before a kill is lost)."""
    kernel_isolation: bool = True
    """Use namespaces, the pids cgroup and capability dropping where the kernel allows. False leaves rlimits,
    the audit hook and the marker scan: the layers that hold where the kernel offers none (tests use it)."""
    temp_root: str | None = None
    """Directory the per-call working directories are made in; None = the system's temporary directory."""

    def __post_init__(self) -> None:
        check(0 < self.timeout_s < math.inf, "timeout_s", self.timeout_s, "be > 0 and finite", "use e.g. 10")
        for name, low in (("cpu_s", 1), ("memory_bytes", 64 << 20), ("output_bytes", 64), ("file_bytes", 0),
                          ("open_files", 16), ("max_processes", 4)):
            value = getattr(self, name)
            check(value >= low, name, value, f"be >= {low}", f"raise `{name}` to at least {low}")
        check(os.access(self.python, os.X_OK), "python", self.python, "be an executable interpreter",
              "use sys.executable or the path of a python3 binary")


@dataclass(kw_only=True, slots=True)
class SandboxResult:
    output: str
    """stdout and stderr interleaved, truncated to output_bytes."""
    end: str
    """Why the call ended: "ok", "exit code N", "timeout after N s", "killed: memory limit",
    "killed: CPU time limit", "killed by signal SIGX"."""
    truncated_bytes: int = 0
    """Output bytes dropped."""
    layers: dict[str, str] = field(default_factory=dict)
    """Which isolation layers took effect (namespaces, network, files, processes, capabilities)."""
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


def _end(status: dict, returncode: int | None, timeout_s: float, timed_out: bool) -> str:
    if timed_out:
        return f"timeout after {timeout_s:g} s"
    reason = status.get("end")
    if reason == "memory":
        return "killed: memory limit"
    if reason == "cpu":
        return "killed: CPU time limit"
    if reason is not None and reason.startswith("signal "):
        return f"killed by signal {reason.removeprefix('signal ')}"
    code = returncode if reason is None else int(reason.removeprefix("exit "))
    return "ok" if code == 0 else f"exit code {code}"


def _env(workdir: str, call_id: str) -> dict[str, str]:
    # nothing inherited: the trainer's environment holds tokens and credentials
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", MARKER: call_id}


def _collect(proc: subprocess.Popen, deadline: float, limit: int) -> tuple[bytearray, int, bool]:
    """Read output until the launcher exits or the deadline passes; keep `limit` bytes. Not until EOF: a
    background process holding the pipe would keep it open."""
    assert proc.stdout is not None
    kept, dropped = bytearray(), 0
    out = proc.stdout.fileno()
    os.set_blocking(out, False)
    exited = os.pidfd_open(proc.pid)
    timed_out, reading, done = False, True, False
    with selectors.DefaultSelector() as sel:
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
    os.close(exited)
    return kept, dropped, timed_out


def _read_status(fd: int) -> dict:
    """The JSON lines PID 1 wrote, merged; whatever it had no time to write is missing."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    os.close(fd)
    status: dict = {}
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            status.update(json.loads(line))
    return status


def run_python(code: str, config: SandboxConfig) -> SandboxResult:
    """Run `code` as a script in the sandbox; never raises for anything the code does."""
    call_id = uuid.uuid4().hex
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="megarl-sandbox-", dir=config.temp_root))
    cgroup = make_pids_cgroup(call_id, config.max_processes) if config.kernel_isolation else None
    status_r, status_w = os.pipe()
    try:
        Path(workdir, _SCRIPT).write_text(code)
        spec = {"workdir": workdir, "script": _SCRIPT, "status_fd": status_w, "cgroup": str(cgroup or ""),
                "namespaces": config.kernel_isolation,
                "cpu_s": config.cpu_s, "memory_bytes": config.memory_bytes, "file_bytes": config.file_bytes,
                "open_files": config.open_files, "max_processes": config.max_processes}
        deadline = time.monotonic() + config.timeout_s
        proc = subprocess.Popen([config.python, "-I", "-u", _CHILD, json.dumps(spec)], cwd=workdir,
                                env=_env(workdir, call_id), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=[status_w], start_new_session=True)
        os.close(status_w)
        status_w = -1
        with proc:
            kept, dropped, timed_out = _collect(proc, deadline, config.output_bytes)
            survivors = reap(proc.pid, call_id, cgroup)
            proc.wait()
        status = _read_status(status_r)
        status_r = -1
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        if cgroup is not None and cgroup.exists():  # Popen failed before reap could remove it
            with contextlib.suppress(OSError):
                cgroup.rmdir()
    layers = {k: v for k, v in status.items() if k != "end"}
    return SandboxResult(output=kept.decode("utf-8", "replace"), truncated_bytes=dropped, layers=layers,
                         end=_end(status, proc.returncode, config.timeout_s, timed_out), survivors=survivors)
