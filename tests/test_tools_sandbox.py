"""The sandbox holds against what model-written code does by mistake or on purpose: endless loops, fork bombs,
memory hogs, network connections, writes outside its directory and processes left behind. Each is run with the
kernel's isolation (namespaces, pids cgroup, no capabilities; where this machine offers them) and without it
(rlimits, audit hook and marker scan only: what holds where the kernel offers nothing)."""

import asyncio
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from megarl.tools import ToolPool
from megarl.tools.python_exec import PythonExecutor
from megarl.tools.reap import MARKER
from megarl.tools.sandbox import SandboxConfig, run_python


def config(kernel, **overrides):
    return SandboxConfig(**{"timeout_s": 5.0, "cpu_s": 2, "memory_bytes": 256 << 20, "kernel_isolation": kernel,
                            **overrides})


def kernel_layers():
    return run_python("pass", config(True)).layers


KERNEL = kernel_layers()
both = pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "fallback"])


def sandbox_processes():
    """Live processes of any sandboxed call, found by the marker in their environment."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if any(var.startswith(MARKER.encode() + b"=") for var in (proc / "environ").read_bytes().split(b"\0")):
                found.append(proc.name)
        except OSError:
            continue
    return found


def processes_running(argument):
    return [p.name for p in Path("/proc").iterdir()
            if p.name.isdigit() and argument.encode() in _read(p / "cmdline").split(b"\0")]


def _read(path):
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_normal_code_runs_fresh_isolated_and_returns_its_output(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    code = ("import os, sys\nprint(sorted(os.listdir('.')), sys.flags.isolated, repr(sys.stdin.read()))\n"
            "print('SECRET_TOKEN' in os.environ, os.getcwd())\nopen('left.txt', 'w').write('x')\n"
            "print('to stderr', file=sys.stderr)\n")
    first = run_python(code, config(True))
    second = run_python(code, config(True))
    assert first.end == second.end == "ok"
    lines = first.observation.splitlines()
    assert lines[0] == "['main.py'] 1 ''" and lines[2] == "to stderr"  # a fresh directory; -I; stdin closed
    assert second.observation.splitlines()[0] == "['main.py'] 1 ''"  # nothing left from the first call
    secret, workdir = lines[1].split()
    assert secret == "False"
    assert workdir != second.observation.splitlines()[1].split()[1] and not os.path.exists(workdir)


def test_exit_codes_and_exceptions_are_reported():
    assert run_python("import sys; sys.exit(3)", config(True)).observation == "[exit code 3]"
    failed = run_python("print('before')\n1 / 0", config(True)).observation
    assert failed.startswith("before\nTraceback") and "ZeroDivisionError" in failed and failed.endswith("[exit code 1]")
    assert "sandbox_child" not in failed  # the traceback starts at the code's frame


def test_output_is_truncated_with_a_marker():
    result = run_python("print('x' * 1000)\nprint('never seen')", config(True, output_bytes=100))
    assert result.end == "ok" and result.truncated_bytes == 1001 + 11 - 100
    assert result.observation == "x" * 100 + "\n... [output truncated: 912 more bytes]"


@both
def test_an_endless_loop_ends_at_its_cpu_limit(kernel):
    start = time.monotonic()
    result = run_python("while True: pass", config(kernel, cpu_s=1))
    assert result.observation == "[killed: CPU time limit]" and time.monotonic() - start < 3


def test_a_sleeping_call_ends_at_its_wall_clock_limit():
    start = time.monotonic()
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(100)", config(True, timeout_s=0.5))
    assert result.observation == "started\n[timeout after 0.5 s]" and time.monotonic() - start < 2
    assert result.layers, "the layers are reported even when the call is killed"


@both
def test_a_memory_hog_is_stopped_and_says_memory(kernel):
    result = run_python("hog = bytearray(512 << 20)\nprint('allocated')", config(kernel))
    assert "allocated" not in result.output and result.end == "killed: memory limit"


@both
def test_a_fork_bomb_ends_and_leaves_no_process(kernel):
    start = time.monotonic()
    result = run_python("import os\nwhile True:\n    os.fork()", config(kernel, timeout_s=1.0))
    assert result.end in ("exit code 1", "timeout after 1 s") and not result.survivors
    assert time.monotonic() - start < 8
    assert sandbox_processes() == []
    if kernel and KERNEL.get("processes") == "cgroup pids.max":
        # the cgroup refused the 33rd process, and the bomb died of it long before its timeout
        assert "BlockingIOError" in result.output and result.end == "exit code 1"
        assert time.monotonic() - start < 0.8


@both
def test_processes_left_in_the_background_are_gone_when_the_call_returns(kernel):
    tag = f"{time.time() % 1000:.6f}"  # a sleep duration no other process uses
    code = (f"import os, subprocess\nsubprocess.Popen(['sleep', '{tag}'], start_new_session=True)\n"
            "if os.fork() == 0:  # a double fork, the grandchild in a session of its own\n    os.setsid()\n"
            f"    if os.fork() == 0:\n        os.execvp('sleep', ['sleep', '{tag}'])\n"
            "    os._exit(0)\nprint('left them running')")
    result = run_python(code, config(kernel))
    assert result.observation == "left them running"
    assert processes_running(tag) == [] and sandbox_processes() == []


def test_the_namespace_kills_a_background_process_that_dropped_its_marker():
    if not KERNEL.get("namespaces", "").startswith("network"):
        pytest.skip(f"no namespaces here: {KERNEL}")
    tag = f"{time.time() % 1000:.6f}"
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{tag}'], env={{}}, start_new_session=True)"
    assert run_python(code, config(True)).end == "ok"
    assert processes_running(tag) == []


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    yield server
    server.close()


@both
def test_a_connection_to_a_listening_port_is_refused(kernel, listener):
    port = listener.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')"
    result = run_python(code, config(kernel))
    assert "network is disabled in this sandbox" in result.observation and result.end == "exit code 1"
    with pytest.raises(TimeoutError):
        listener.accept()
    expected = "namespace + audit hook" if kernel and KERNEL["namespaces"].startswith("network") else "audit hook only"
    assert result.layers["network"] == expected


def test_programs_other_than_python_have_no_network_and_write_nothing_outside(listener, tmp_path):
    if KERNEL.get("files") != "read-only mounts":
        pytest.skip(f"no namespaces here, so only Python's own calls are checked: {KERNEL}")
    port = listener.getsockname()[1]
    outside = tmp_path / "outside.txt"
    code = ("import subprocess\n"
            f"subprocess.run(['bash', '-c', 'echo leak > /dev/tcp/127.0.0.1/{port}; echo x > {outside}'])")
    result = run_python(code, config(True))
    assert "Network is unreachable" in result.output and "Read-only file system" in result.output
    with pytest.raises(TimeoutError):
        listener.accept()
    assert not outside.exists()


@both
def test_writes_outside_the_working_directory_are_refused(kernel, tmp_path):
    outside = tmp_path / f"outside-{uuid.uuid4().hex}"
    code = (f"open('inside.txt', 'w').write('fine')\nimport os\nprint(os.path.getsize('inside.txt'))\n"
            f"for attempt in (lambda: open({str(outside)!r}, 'w'), lambda: os.mkdir({str(outside)!r}),\n"
            f"                lambda: os.symlink({str(tmp_path)!r}, 'link') or open('link/through_link', 'w')):\n"
            "    try:\n        attempt()\n    except OSError as err:\n        print(type(err).__name__, err)\n")
    result = run_python(code, config(kernel))
    lines = result.observation.splitlines()
    assert lines[0] == "4" and len(lines) == 4
    assert all(line.startswith("PermissionError") and "refused" in line for line in lines[1:])
    assert not outside.exists() and not (tmp_path / "through_link").exists()


def test_the_python_tool_reports_how_the_call_ended_and_which_layers_held():
    tool = PythonExecutor(timeout_s=5.0, cpu_s=1)
    ok, looped = tool.run("print(6 * 7)"), tool.run("while True: pass")
    assert (ok.text, ok.status, ok.metadata["end"]) == ("42", "ok", "ok")
    assert ok.metadata["isolation"] == KERNEL and set(KERNEL) == {"namespaces", "network", "files", "processes",
                                                                   "capabilities"}
    assert (looped.status, looped.text) == ("error", "[killed: CPU time limit]")
    assert PythonExecutor(timeout_s=0.3).run("import time; time.sleep(5)").status == "timeout"


@pytest.mark.parametrize("field, value, must", [
    ("timeout_s", 0, "be > 0"), ("memory_bytes", 1 << 20, "be >= 67108864"), ("max_processes", 1, "be >= 4"),
    ("python", "/no/such/python", "be an executable interpreter"),
])
def test_bad_config_values_are_named(field, value, must):
    with pytest.raises(ValueError, match=f"`{field}` = .*{must}.* Fix: "):
        SandboxConfig(**{field: value})


def test_sandboxed_calls_run_side_by_side_in_a_pool():
    pool = ToolPool([PythonExecutor(timeout_s=5.0)], max_workers=4)

    async def main():
        start = time.monotonic()
        results = await asyncio.gather(*(pool.run("python", f"import time\ntime.sleep(0.5)\nprint({i})")
                                         for i in range(4)))
        return results, time.monotonic() - start

    try:
        results, took = asyncio.run(main())
    finally:
        pool.close()
    assert [r.observation for r in results] == ["0", "1", "2", "3"] and took < 1.2
    assert all(r.metadata["isolation"] == KERNEL for r in results)
