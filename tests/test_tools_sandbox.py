"""The sandbox's ordinary behaviour: fresh calls, output and its truncation, how a call ended, the limits, the
tool's report, the refusal of a machine that cannot isolate, and the unsafe-none mode a user opts into by name.
What it holds against hostile code is tests/test_sandbox_attacks.py."""

import asyncio
import os
import subprocess
import sys
import warnings

import pytest

from megarl.errors import UserError
from megarl.tools import ToolPool, bwrap, sandbox
from megarl.tools.python_exec import PythonExecutor
from megarl.tools.sandbox import SandboxConfig, run_python


def config(**overrides):
    return SandboxConfig(**{"timeout_s": 5.0, "cpu_s": 2, "memory_bytes": 256 << 20, **overrides})


def unsafe(**overrides):
    return config(isolation="unsafe-none", **overrides)


def test_normal_code_runs_fresh_and_returns_its_output(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    code = ("import os, sys\nprint(sorted(os.listdir('.')), sys.flags.isolated, repr(sys.stdin.read()))\n"
            "print('SECRET_TOKEN' in os.environ, os.getcwd(), os.getuid())\nopen('left.txt', 'w').write('x')\n"
            "import helper_mod\nprint('to stderr', file=sys.stderr)\n")
    first = run_python("open('helper_mod.py', 'w').write('')\n" + code, config())
    second = run_python(code, config())
    assert first.end == "ok", first.observation
    lines = first.observation.splitlines()
    assert lines[0] == "['helper_mod.py', 'main.py'] 1 ''" and lines[2] == "to stderr"  # -I; stdin closed
    assert lines[1] == f"False {bwrap.WORKDIR} {bwrap.UID}"  # none of the trainer's environment; nobody
    assert second.observation.splitlines()[0] == "['main.py'] 1 ''"  # nothing left from the first call
    assert "ModuleNotFoundError" in second.observation


def test_exit_codes_and_exceptions_are_reported():
    assert run_python("import sys; sys.exit(3)", config()).observation == "[exit code 3]"
    failed = run_python("print('before')\n1 / 0", config()).observation
    assert failed.startswith("before\nTraceback") and "ZeroDivisionError" in failed and failed.endswith("[exit code 1]")
    assert "init.py" not in failed  # the traceback starts at the code's frame


def test_output_is_truncated_with_a_marker():
    result = run_python("print('x' * 1000)\nprint('never seen')", config(output_bytes=100))
    assert result.end == "ok" and result.truncated_bytes == 1001 + 11 - 100
    assert result.observation == "x" * 100 + "\n... [output truncated: 912 more bytes]"


@pytest.mark.parametrize("make", [config, unsafe], ids=["bwrap", "unsafe-none"])
def test_an_endless_loop_ends_at_its_cpu_limit(make):
    result = run_python("while True: pass", make(cpu_s=1))
    assert result.observation == "[killed: CPU time limit]"  # not the 5 s wall clock's timeout


def test_a_sleeping_call_ends_at_its_wall_clock_limit():
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(100)", config(timeout_s=0.5))
    assert result.observation == "started\n[timeout after 0.5 s]"
    assert result.layers, "the layers are reported even when the call is killed"


@pytest.mark.parametrize("make", [config, unsafe], ids=["bwrap", "unsafe-none"])
def test_an_allocation_beyond_the_limit_raises_memory_error(make):
    result = run_python("hog = bytearray(512 << 20)\nprint('allocated')", make())
    assert result.observation.endswith("MemoryError\n[exit code 1]") and "allocated" not in result.output


def test_a_call_over_its_memory_is_killed_and_says_memory():
    if run_python("pass", config()).layers["limits"].startswith("none"):
        pytest.skip("no cgroup here: memory is limited per process only (docs/tools.md)")
    # 180 MiB on the call's tmpfs and 150 MiB in a process: each within the process's address space limit, the
    # two together over the call's 256 MiB
    code = ("for where in ('.', '/tmp', '/dev/shm'):\n    open(f'{where}/fill', 'wb').write(b'x' * (60 << 20))\n"
            "hog = b'y' * (150 << 20)\nprint('allocated')\n")
    result = run_python(code, config(disk_bytes=64 << 20, file_bytes=64 << 20))
    assert result.end == "killed: memory limit" and "allocated" not in result.output, result.observation


def test_the_python_tool_reports_how_the_call_ended_and_what_confined_it():
    tool = PythonExecutor(timeout_s=5.0, cpu_s=1)
    ok, looped = tool.run("print(6 * 7)"), tool.run("while True: pass")
    assert (ok.text, ok.status, ok.metadata["end"]) == ("42", "ok", "ok")
    assert set(ok.metadata["isolation"]) == {"sandbox", "seccomp", "uid", "limits"}
    assert (looped.status, looped.text) == ("error", "[killed: CPU time limit]")
    assert PythonExecutor(timeout_s=0.3).run("import time; time.sleep(5)").status == "timeout"
    # Arguments written as an object (Qwen's tool format): the program, not a dict literal that prints nothing.
    assert tool.run('{"code": "print(6 * 7)"}').text == "42"
    assert tool.run('{"a": 1, "b": "print(1)"}').text == "(no output)"


@pytest.mark.parametrize("field, value, must", [
    ("timeout_s", 0, "be > 0"), ("memory_bytes", 1 << 20, "be >= 67108864"), ("max_processes", 1, "be >= 4"),
    ("python", "/no/such/python", "be an executable interpreter"), ("isolation", "none", "be bwrap or unsafe-none"),
])
def test_bad_config_values_are_named(field, value, must):
    with pytest.raises(ValueError, match=f"`{field}` = .*{must}.* Fix: "):
        SandboxConfig(**{field: value})


def test_a_machine_that_cannot_isolate_is_refused_when_the_tool_is_built(monkeypatch):
    monkeypatch.setattr(bwrap, "executable", lambda: None)
    sandbox._isolation_problem.cache_clear()
    try:
        with pytest.raises(UserError, match="bwrap is not installed.*Fix: install bubblewrap.*unsafe-none"):
            PythonExecutor()
    finally:
        sandbox._isolation_problem.cache_clear()
    with pytest.warns(UserWarning, match="unsafe-none.*only for code you would run yourself"):
        tool = PythonExecutor(isolation="unsafe-none")  # by name only, and with a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tool.run("print(1)").text == "1"


@pytest.mark.skipif(os.geteuid() != 0, reason="host_uid is for a root trainer")
def test_a_host_uid_that_cannot_reach_the_interpreter_is_refused_naming_the_path():
    uid, python = 61236, os.path.realpath(sys.executable)
    if subprocess.run(["test", "-x", python], user=uid, group=uid, extra_groups=[]).returncode == 0:
        pytest.skip(f"uid {uid} can run {python} here")
    with pytest.raises(UserError, match=r"printed \"bwrap: Can't find source path /.*: Permission denied.*`host_uid`"):
        PythonExecutor(host_uid=uid)


def test_sandboxed_calls_run_side_by_side_in_a_pool():
    pool = ToolPool([PythonExecutor(timeout_s=5.0)], max_workers=4)

    async def main():
        return await asyncio.gather(*(pool.run("python", f"import time\nprint({i}, time.time(), flush=True)\n"
                                               "time.sleep(2)\nprint(time.time())") for i in range(4)))

    results = asyncio.run(main())
    lines = [r.observation.split() for r in results]
    assert [line[0] for line in lines] == ["0", "1", "2", "3"]
    # Side by side, every call starts before any ends (the host's clock is theirs); one after another none would.
    assert max(float(line[1]) for line in lines) < min(float(line[2]) for line in lines)
