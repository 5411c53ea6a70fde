"""Running tool calls concurrently from an asyncio event loop: a bounded number at a time, each with a deadline,
every failure turned into observation text."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from megarl.tools.base import Status, Tool, ToolOutput


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
    """Runs calls to `tools` with at most `max_workers` at once, each cut off after `timeout_s`.

    Sync tools run in a thread pool of `max_workers` threads, so the caller's loop never blocks. A thread cannot
    be stopped: a sync call past its timeout is reported as a timeout at once but keeps its worker until it
    returns, so overrunning calls cannot pile up beyond `max_workers`.
    """

    def __init__(self, tools: Iterable[Tool], *, max_workers: int = 8, timeout_s: float = 30.0) -> None:
        if max_workers < 1 or timeout_s <= 0:
            raise ValueError(f"ToolPool(max_workers={max_workers}, timeout_s={timeout_s}): both must be positive.")
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}. Fix: give each tool of a pool its own name.")
            self.tools[tool.name] = tool
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_workers)
        self._threads = ThreadPoolExecutor(max_workers, thread_name_prefix="megarl-tool")

    async def run(self, tool_name: str, call: str, seed: int | None = None) -> ToolResult:
        """Run one call; never raises for anything the tool does. ``seed`` goes to tools whose ``run`` takes one."""
        tool = self.tools.get(tool_name)
        if tool is None:
            return ToolResult(observation=f"error: no tool named {tool_name!r}; tools: {sorted(self.tools)}",
                              status="error", wall_s=0.0)
        await self._slots.acquire()
        start = time.monotonic()
        task = asyncio.ensure_future(self._call(tool, call, seed))
        try:
            out = await asyncio.wait_for(asyncio.shield(task), self.timeout_s)
        except TimeoutError:
            if inspect.iscoroutinefunction(tool.run):
                task.cancel()
            return ToolResult(observation=f"timeout after {self.timeout_s:g} s", status="timeout",
                              wall_s=time.monotonic() - start)
        except Exception as err:
            return ToolResult(observation=f"error: {type(err).__name__}: {err}", status="error",
                              wall_s=time.monotonic() - start)
        finally:
            # the slot is free once the call really ends, not when we stop waiting for it
            task.add_done_callback(lambda _: self._slots.release())
        wall_s = time.monotonic() - start
        if isinstance(out, ToolOutput):
            return ToolResult(observation=out.text, status=out.status, wall_s=wall_s, metadata=out.metadata)
        return ToolResult(observation=out, status="ok", wall_s=wall_s)

    async def _call(self, tool: Tool, call: str, seed: int | None) -> str | ToolOutput:
        seeded = seed is not None and "seed" in inspect.signature(tool.run).parameters
        run: Any = functools.partial(tool.run, call, **({"seed": seed} if seeded else {}))
        if inspect.iscoroutinefunction(tool.run):
            out = await run()
        else:
            out = await asyncio.get_running_loop().run_in_executor(self._threads, run)
        if not isinstance(out, str | ToolOutput):
            raise TypeError(f"tool {tool.name!r} returned a {type(out).__name__}, not a str or ToolOutput")
        return out

    def close(self) -> None:
        """Let the threads go once their calls end (a sync call past its timeout may still be running)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
