"""The tool layer of agentic rollouts: load_tool's errors, the calculator's results and refusals, and ToolPool's
promises (bounded concurrency, a free event loop, every failure or timeout as observation text)."""

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from megarl.tools import ToolOutput, ToolPool, load_tool
from megarl.tools.calculator import Calculator, calculate


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", "14"), ("(1 + 2) ** 3", "27"), ("7 / 2", "3.5"), ("-7 // 2", "-4"), ("7 % 3", "1"),
    ("2 ** -1", "0.5"), ("1e3 * 2", "2000"), ("-(4 - 10)", "6"), ("2 ** 100", str(2**100)),
    ("0.1 + 0.2", "0.30000000000000004"), ("-" * 900 + "5", "5"),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert Calculator().run(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("9**9**9", "too large"), ("10 ** 10000", "too large"), ("2 ** 4000 * 2 ** 4000", "too large"),
    ("2.0 ** 10000", "too large for a float"), ("1 / 0", "division by zero"), ("(-8) ** 0.5", "complex"),
    ("__import__('os').system('true')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"), ("'a' * 3", "Constant is not allowed"), ("True + 1", "Constant"),
    ("1 +", "not an arithmetic expression"), ("(" * 300 + "1" + ")" * 300, "too many nested parentheses"),
    ("1+" * 600 + "1", "too long"),
])
def test_calculator_refuses_at_once(expression, why):
    start = time.monotonic()
    with pytest.raises(ValueError, match=why):
        calculate(expression)
    assert time.monotonic() - start < 2  # at once: evaluating any of them would not end for minutes


def test_load_tool_builds_the_built_ins_with_their_arguments():
    assert load_tool("megarl.tools.calculator:Calculator").name == "calculator"
    python = load_tool("megarl.tools.python_exec:PythonExecutor", timeout_s=3)
    assert python.name == "python" and python.description and python.config.timeout_s == 3


@pytest.fixture
def tool_module(tmp_path, monkeypatch):
    (tmp_path / "broken_tools.py").write_text("raise RuntimeError('half-written module')\n")
    (tmp_path / "needy_tools.py").write_text("import not_installed_anywhere\n")
    (tmp_path / "odd_tools.py").write_text(textwrap.dedent("""
        class NoRun:
            name = "norun"
            description = "cannot run"

        class Nameless:
            description = "no name"
            def run(self, call):
                return call

        not_a_class = 3

        class NeedsAFile:
            name = "needs"
            description = "opens a file when built"
            def __init__(self, path="/nonexistent/words.txt"):
                open(path)
            def run(self, call):
                return call
    """))
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("spec, kwargs, says", [
    ("calculator", {}, ["not an import path", "package.module:Class"]),
    ("megarl.tools.no_such_module:Tool", {}, ["no module named 'megarl.tools.no_such_module'", "PYTHONPATH"]),
    ("broken_tools:Tool", {}, ["importing module 'broken_tools' failed", "RuntimeError: half-written module"]),
    ("needy_tools:Tool", {}, ["needs 'not_installed_anywhere'", "install"]),
    ("megarl.tools.calculator:Calc", {}, ["has no attribute 'Calc'", "'Calculator'"]),
    ("odd_tools:not_a_class", {}, ["int, not a class", "'NoRun'"]),
    ("odd_tools:NoRun", {}, ["NoRun is not a tool: it lacks run", "run(self, call: str)"]),
    ("odd_tools:Nameless", {}, ["lacks name", "non-empty `name`"]),
    ("megarl.tools.calculator:Calculator", {"precision": 3}, ["Calculator(precision=3) failed", "arguments"]),
    ("odd_tools:NeedsAFile", {}, ["NeedsAFile() raised FileNotFoundError: [Errno 2]", "agent.tools[].args"]),
])
def test_load_tool_explains_in_one_paragraph(tool_module, spec, kwargs, says):
    with pytest.raises(ValueError) as info:
        load_tool(spec, **kwargs)
    message = str(info.value)
    assert message.startswith(f"tool {spec!r}") and "Fix:" in message and "\n" not in message
    for part in says:
        assert part in message


class Sleepy:
    name = "sleepy"
    description = "sleeps"

    def __init__(self, seconds=0.3):
        self.seconds = seconds

    def run(self, call):
        time.sleep(self.seconds)
        return f"slept {call}"


class AsyncSleepy(Sleepy):
    name = "async_sleepy"

    async def run(self, call):
        await asyncio.sleep(self.seconds)
        return ToolOutput(text=f"awoke {call}", metadata={"seconds": self.seconds})


class Faulty:
    name = "faulty"
    description = "raises or returns the wrong type"

    def run(self, call):
        if call == "raise":
            raise RuntimeError("boom")
        return 42


def run_calls(pool, calls):
    async def main():
        start = time.monotonic()
        results = await asyncio.gather(*(pool.run(name, call) for name, call in calls))
        return results, time.monotonic() - start
    return asyncio.run(main())


class Meeting:
    """Calls that meet: each waits until ``parties`` calls run at once (20 s at most, then it fails), then holds for
    the seconds its call names; counts the calls in flight and their peak."""

    name = "meeting"
    description = "meets"

    def __init__(self, parties=4):
        self.parties, self.running, self.peak = parties, 0, 0
        self.lock, self.barrier = threading.Lock(), threading.Barrier(parties, timeout=20)

    def enter(self):
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)

    def leave(self):
        with self.lock:
            self.running -= 1

    def run(self, call):
        self.enter()
        try:
            self.barrier.wait()
            time.sleep(float(call.split()[0]))
        finally:
            self.leave()
        return f"met {call}"


class AsyncMeeting(Meeting):
    name = "async_meeting"

    async def run(self, call):
        if not hasattr(self, "async_barrier"):
            self.async_barrier = asyncio.Barrier(self.parties)
        self.enter()
        try:
            await asyncio.wait_for(self.async_barrier.wait(), 20)
            await asyncio.sleep(float(call.split()[0]))
        finally:
            self.leave()
        return ToolOutput(text=f"met {call}", metadata={})


@pytest.mark.parametrize("make", [Meeting, AsyncMeeting])
def test_pool_runs_calls_concurrently_bounded_by_its_workers(make):
    """Every call waits until four run at once, so on fewer workers they would fail; never more than the four
    workers run at once; and the calls queued behind 2-second ones report their own time, not the wait."""
    tool = make(parties=4)
    calls = [(tool.name, f"{2.0 if i < 4 else 0.0} {i}") for i in range(8)]
    results, _ = run_calls(ToolPool([tool], max_workers=4), calls)
    assert [r.status for r in results] == ["ok"] * 8 and results[2].observation.endswith(" 2")
    assert tool.peak == 4
    assert all(r.wall_s >= 2.0 for r in results[:4]) and all(r.wall_s < 1.0 for r in results[4:])


def test_sync_calls_leave_the_event_loop_free():
    pool = ToolPool([Sleepy()], max_workers=2)

    async def main():
        ticks = 0
        calls = asyncio.gather(pool.run("sleepy", "a"), pool.run("sleepy", "b"))
        while not calls.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return ticks

    assert asyncio.run(main()) > 10


def test_tool_failures_and_timeouts_become_observations():
    pool = ToolPool([Faulty(), Sleepy(seconds=1.0), AsyncSleepy(seconds=1.0)], max_workers=4, timeout_s=0.2)
    results, took = run_calls(pool, [("faulty", "raise"), ("faulty", "other"), ("sleepy", "x"),
                                     ("async_sleepy", "x"), ("search", "x")])
    raised, wrong_type, sync_late, async_late, unknown = results
    assert (raised.status, raised.observation) == ("error", "error: RuntimeError: boom")
    assert wrong_type.status == "error" and "returned a int, not a str or ToolOutput" in wrong_type.observation
    for late in (sync_late, async_late):
        assert (late.status, late.observation) == ("timeout", "timeout after 0.2 s") and late.wall_s < 0.4
    assert unknown.status == "error" and "no tool named 'search'" in unknown.observation
    assert took < 0.5


class Exiting:
    """A tool that parses its call with argparse, which exits on one it cannot parse."""

    name = "exiting"
    description = "argparse"

    def run(self, call):
        import argparse

        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--n", type=int, required=True)
        return str(2 * parser.parse_args(call.split()).n)


class AsyncExiting(Exiting):
    name = "async_exiting"

    async def run(self, call):
        if call == "interrupt":
            raise KeyboardInterrupt
        return Exiting.run(self, call)


def test_a_tool_that_exits_is_an_error_of_its_call_and_frees_its_worker(capsys):
    """argparse calls sys.exit on a call it cannot parse: a sync tool's thread ended silently, its call reported
    a timeout and its worker was never given back (after two, every call of every tool was refused); an async
    tool's SystemExit ended the tools' event loop. Now each is that call's error, and the next calls run."""
    pool = ToolPool([Exiting(), AsyncExiting()], max_workers=2, timeout_s=5)
    calls = [("exiting", "oops"), ("exiting", "oops"), ("async_exiting", "oops"), ("async_exiting", "interrupt"),
             ("exiting", "--n 3"), ("async_exiting", "--n 4")]

    async def main():
        return [await pool.run(name, call) for name, call in calls]

    results = asyncio.run(main())
    assert [r.status for r in results] == ["error"] * 4 + ["ok"] * 2, results
    assert "the tool raised SystemExit(2) instead of returning" in results[0].observation
    assert "the tool raised KeyboardInterrupt() instead of returning" in results[3].observation
    assert [r.observation for r in results[4:]] == ["6", "8"] and all(r.wall_s < 1 for r in results)


def test_a_timed_out_sync_call_keeps_its_worker_and_later_calls_do_not_wait_for_it():
    """A thread cannot be stopped: the overrunning call keeps its worker, and a call that finds every worker held
    so is a timeout at once instead of waiting for a worker that may never come back."""
    pool = ToolPool([Sleepy(seconds=0.5)], max_workers=1, timeout_s=0.1)

    async def main():
        first = await pool.run("sleepy", "a")
        second = await pool.run("sleepy", "b")
        await asyncio.sleep(0.6)  # the first call's thread has returned: its worker is free again
        third = await pool.run("sleepy", "c")
        return first, second, third

    first, second, third = asyncio.run(main())
    assert (first.status, first.observation) == ("timeout", "timeout after 0.1 s")
    assert (second.status, second.wall_s) == ("timeout", 0.0)
    assert second.observation == "timeout: all 1 tool workers are held by calls past their 0.1 s"
    assert third.status == "timeout" and third.wall_s > 0  # it ran (and overran) on the freed worker


def test_the_pool_passes_on_a_tools_output_metadata():
    results, _ = run_calls(ToolPool([AsyncSleepy(seconds=0.01), Calculator()]),
                           [("async_sleepy", "x"), ("calculator", "6 * 7"), ("calculator", "9**9**9")])
    assert results[0].observation == "awoke x" and results[0].metadata == {"seconds": 0.01}
    assert results[1].observation == "42"
    assert results[2].status == "error" and results[2].observation.startswith("error: ValueError: exponent")


def test_a_pool_refuses_two_tools_of_one_name():
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolPool([Calculator(), Calculator()])


class Hung:
    name = "hung"
    description = "never returns, ignoring every deadline"

    def run(self, call):
        threading.Event().wait()


def test_a_hung_sync_tool_never_holds_a_call_past_its_deadline():
    """Ten calls to a tool that never returns, on two workers: each is a timeout, none waits for a worker that
    never comes back (the issue's probe: training hung forever once the hung calls held every worker)."""
    pool = ToolPool([Hung()], max_workers=2, timeout_s=0.2)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(pool.run("hung", str(i)) for i in range(10))), 60)

    assert [r.status for r in asyncio.run(main())] == ["timeout"] * 10


HUNG_RUN = """
import asyncio, sys, threading
from megarl.run.command import run_main
from megarl.run.interrupt import install
from megarl.tools import ToolPool
sys.path.insert(0, {tests!r})
from test_tools_base import Hung

def main():
    install()
    pool = ToolPool([Hung()], max_workers=1, timeout_s=0.5)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    print(asyncio.run_coroutine_threadsafe(pool.run("hung", "x"), loop).result().status, flush=True)
    threading.Event().wait()  # the trainer's next phase, with the hung call's thread still running

run_main(main)
"""


def test_a_signal_ends_the_run_while_a_sync_tool_hangs(tmp_path):
    """SIGTERM ends the process although a tool's thread never returns (it used to print "interrupted" and then
    hang at exit, joining the executor's threads, until kill -9)."""
    proc = subprocess.Popen([sys.executable, "-c", HUNG_RUN.format(tests=str(Path(__file__).parent))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "timeout"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "megarl: interrupted by SIGTERM" in err, err


class Flood:
    name = "flood"
    description = "returns or prints 6 MB"

    def run(self, call):
        if call == "print":
            for _ in range(6):
                print("x" * 2**20)
            return "printed"
        return "y" * 6 * 2**20


class AsyncFlood(Flood):
    name = "async_flood"

    async def run(self, call):
        return Flood.run(self, call)


def test_tool_output_is_capped_in_the_observation_and_on_the_console(capfd):
    pool = ToolPool([Flood(), AsyncFlood()], output_chars=1000)
    results, _ = run_calls(pool, [("flood", "return"), ("async_flood", "return"), ("flood", "print"),
                                  ("async_flood", "print")])
    for big in results[:2]:
        assert big.observation == "y" * 1000 + f"\n[tool output cut: {6 * 2**20 - 1000} more characters]"
    assert [r.observation for r in results[2:]] == ["printed"] * 2
    print("outside a call: not capped " + "z" * 2000)
    out = capfd.readouterr().out
    assert len(out) < 5000 and out.count("printed more than it may") == 2 and "z" * 2000 in out
