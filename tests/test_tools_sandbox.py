"""The sandbox's ordinary behaviour: fresh calls, output and its truncation, how a call ended, the limits, the
tool's report, the refusal of a machine that cannot isolate, and the unsafe-none mode a user opts into by name.
What it holds against hostile code is tests/test_sandbox_attacks.py."""

import asyncio
import time
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
    start = time.monotonic()
    result = run_python("while True: pass", make(cpu_s=1))
    assert result.observation == "[killed: CPU time limit]" and time.monotonic() - start < 8  # slack: a loaded host


def test_a_sleeping_call_ends_at_its_wall_clock_limit():
    start = time.monotonic()
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(100)", config(timeout_s=0.5))
    assert result.observation == "started\n[timeout after 0.5 s]" and time.monotonic() - start < 4
    assert result.layers, "the layers are reported even when the call is killed"


@pytest.mark.parametrize("make", [config, unsafe], ids=["bwrap", "unsafe-none"])
def test_a_memory_hog_is_stopped_and_says_memory(make):
    result = run_python("hog = bytearray(512 << 20)\nprint('allocated')", make())
    assert "allocated" not in result.output and result.end == "killed: memory limit"


def test_the_python_tool_reports_how_the_call_ended_and_what_confined_it():
    tool = PythonExecutor(timeout_s=5.0, cpu_s=1)
    ok, looped = tool.run("print(6 * 7)"), tool.run("while True: pass")
    assert (ok.text, ok.status, ok.metadata["end"]) == ("42", "ok", "ok")
    assert set(ok.metadata["isolation"]) == {"sandbox", "seccomp", "uid", "limits"}
    assert (looped.status, looped.text) == ("error", "[killed: CPU time limit]")
    assert PythonExecutor(timeout_s=0.3).run("import time; time.sleep(5)").status == "timeout"


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


def test_sandboxed_calls_run_side_by_side_in_a_pool():
    pool = ToolPool([PythonExecutor(timeout_s=5.0)], max_workers=4)

    async def main():
        start = time.monotonic()
        results = await asyncio.gather(*(pool.run("python", f"import time\ntime.sleep(2)\nprint({i})")
                                         for i in range(4)))
        return results, time.monotonic() - start

    results, took = asyncio.run(main())
    # One after another they would take 8 s; side by side 2 s and the sandboxes' start-up (seconds of slack: a
    # loaded host)
    assert [r.observation for r in results] == ["0", "1", "2", "3"] and took < 5
