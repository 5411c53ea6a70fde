"""Running tool calls concurrently from an asyncio event loop: a bounded number at a time, each with a deadline
that holds whatever the tool does, every failure turned into observation text, every output capped."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from megarl.tools.base import Status, Tool, ToolOutput
from megarl.tools.output import CALL_BUDGET, PrintBudget, cap, cap_console


@dataclass(kw_only=True, slots=True)
class ToolResult:
    observation: str
    """The text the model sees next."""
    status: Status
    """ok, error (the tool raised, or the call named no tool) or timeout."""
    wall_s: float
    """Seconds from the call's start (after waiting for a worker) to its result."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The tool's ToolOutput.metadata, if it gave one."""


class ToolPool:
    """Runs calls to `tools` with at most `max_workers` at once, each cut off after `timeout_s`, its observation
    and its prints capped at `output_chars` characters.

    Sync tools run each in a daemon thread of its own, so the caller's loop never blocks and neither the end of
    the run nor a signal ever waits for one. A thread cannot be stopped: a sync call past its timeout is reported
    as a timeout at once but keeps its worker until it returns, so overrunning calls cannot pile up beyond
    `max_workers`; once every worker is held by an overrunning call, a call is a timeout at once rather than wait
    for a worker that may never come back. So no call's result takes longer than `timeout_s`.
    """

    def __init__(self, tools: Iterable[Tool], *, max_workers: int = 8, timeout_s: float = 30.0,
                 output_chars: int = 16384) -> None:
        if max_workers < 1 or timeout_s <= 0 or output_chars < 1:
            raise ValueError(f"ToolPool(max_workers={max_workers}, timeout_s={timeout_s}, output_chars="
                             f"{output_chars}): all must be positive.")
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}. Fix: give each tool of a pool its own name.")
            self.tools[tool.name] = tool
        self.max_workers, self.timeout_s, self.output_chars = max_workers, timeout_s, output_chars
        self._busy = 0
        self._overran: set[asyncio.Future[Any]] = set()  # calls past their timeout that still hold a worker
        self._changed = asyncio.Event()
        cap_console()

    async def run(self, tool_name: str, call: str, seed: int | None = None) -> ToolResult:
        """Run one call; never raises for anything the tool does. ``seed`` goes to tools whose ``run`` takes one."""
        tool = self.tools.get(tool_name)
        if tool is None:
            return ToolResult(observation=f"error: no tool named {tool_name!r}; tools: {sorted(self.tools)}",
                              status="error", wall_s=0.0)
        if not await self._take_worker():
            return ToolResult(observation=f"timeout: all {self.max_workers} tool workers are held by calls past "
                              f"their {self.timeout_s:g} s", status="timeout", wall_s=0.0)
        start = time.monotonic()
        task = asyncio.ensure_future(self._call(tool, call, seed))
        task.add_done_callback(self._give_back)  # the worker is free once the call really ends
        try:
            out = await asyncio.wait_for(asyncio.shield(task), self.timeout_s)
        except TimeoutError:
            if not task.done():
                self._overran.add(task)
                self._changed.set()  # callers waiting for a worker may now have none to wait for
                if inspect.iscoroutinefunction(tool.run):
                    task.cancel()  # ends it at its next await; a thread cannot be stopped and keeps its worker
            return ToolResult(observation=f"timeout after {self.timeout_s:g} s", status="timeout",
                              wall_s=time.monotonic() - start)
        except Exception as err:
            return ToolResult(observation=cap(f"error: {type(err).__name__}: {err}", self.output_chars),
                              status="error", wall_s=time.monotonic() - start)
        wall_s = time.monotonic() - start
        if isinstance(out, ToolOutput):
            return ToolResult(observation=cap(out.text, self.output_chars), status=out.status, wall_s=wall_s,
                              metadata=out.metadata)
        return ToolResult(observation=cap(out, self.output_chars), status="ok", wall_s=wall_s)

    async def _take_worker(self) -> bool:
        """Wait for a free worker; False at once when every worker is held by an overrunning call."""
        while self._busy >= self.max_workers:
            if len(self._overran) >= self.max_workers:
                return False
            self._changed.clear()
            await self._changed.wait()
        self._busy += 1
        return True

    def _give_back(self, task: asyncio.Future[Any]) -> None:
        self._busy -= 1
        self._overran.discard(task)
        self._changed.set()

    async def _call(self, tool: Tool, call: str, seed: int | None) -> str | ToolOutput:
        seeded = seed is not None and "seed" in inspect.signature(tool.run).parameters
        run: Any = functools.partial(tool.run, call, **({"seed": seed} if seeded else {}))
        budget = PrintBudget(tool.name, self.output_chars)
        if inspect.iscoroutinefunction(tool.run):
            CALL_BUDGET.set(budget)  # this task's context: the tool's coroutine runs in it
            try:
                out = await run()
            except (SystemExit, KeyboardInterrupt) as raised:  # out of the loop, they would end the tools' thread
                raise exited(raised) from None
        else:
            out = await _in_daemon_thread(run, budget, f"megarl-tool-{tool.name}")
        if not isinstance(out, str | ToolOutput):
            raise TypeError(f"tool {tool.name!r} returned a {type(out).__name__}, not a str or ToolOutput")
        return out


def exited(raised: BaseException) -> RuntimeError:
    """A tool's SystemExit or KeyboardInterrupt (argparse exits on a call it cannot parse) as the call's error: the
    call is the tool's, the process and the tools' thread are not."""
    return RuntimeError(f"the tool raised {type(raised).__name__}({raised}) instead of returning; a tool returns its "
                        "errors as text")


def _in_daemon_thread(run: Callable[[], Any], budget: PrintBudget, name: str) -> asyncio.Future[Any]:
    """`run()` (a tool's call) in a daemon thread of its own: unlike an executor's threads, which the interpreter joins
    at exit, a hung call cannot keep the process alive after a signal or the run's end."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(out: Any, err: BaseException | None) -> None:
        if future.done():  # the call was given up
            return
        if err is None:
            future.set_result(out)
        else:
            future.set_exception(err)

    def work() -> None:
        CALL_BUDGET.set(budget)
        out, err = None, None
        try:
            out = run()
        except Exception as raised:
            err = raised
        except (SystemExit, KeyboardInterrupt) as raised:  # would end this thread silently, the call never settled
            err = exited(raised)
        try:
            loop.call_soon_threadsafe(settle, out, err)
        except RuntimeError:  # the loop is closed: nobody waits for this call any more
            pass

    threading.Thread(target=work, name=name, daemon=True).start()
    return future
