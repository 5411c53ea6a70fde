"""The tool interface of agentic rollouts, and loading a tool by import path ("package.module:Class").

A tool is any object with a `name`, a `description` (text for the prompt) and `run(call: str)`, plain or
`async def`; it returns the observation as a string, or a `ToolOutput` when it has a status or metadata to
report. `ToolPool` (pool.py) runs the calls.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from megarl.config.imports import import_spec
from megarl.errors import UserError

Status = Literal["ok", "error", "timeout"]


@dataclass(kw_only=True, slots=True)
class ToolOutput:
    text: str
    """The observation the model sees."""
    status: Status = "ok"
    """How the call went, as the tool judges it (the sandbox's timeout is "timeout")."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything for logs and metrics, not for the model (e.g. the sandbox's isolation layers)."""


@runtime_checkable
class Tool(Protocol):
    name: str
    """What the model writes to call it; unique within a pool."""
    description: str
    """What the prompt says it does and how to call it."""

    def run(self, call: str) -> str | ToolOutput | Awaitable[str | ToolOutput]:
        """Run one call; sync tools run in the pool's threads, `async def` ones on its event loop. A tool that draws
        at random may take a keyword `seed: int` and draw from it alone: the agent loop passes the sample's seed of
        the turn that made the call (none when sampling is unseeded), so its result is the same however calls
        overlap in time, however many workers run them and in whatever order they finish."""
        ...


def load_tool(spec: str, **kwargs: Any) -> Tool:
    """Import `module:Class` and build it with `kwargs`; one ValueError paragraph (spec, what failed, the fix)
    for anything that keeps it from being a tool."""
    where = f"tool {spec!r}"
    module, attr = import_spec(spec, where, "Class")
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        classes = sorted(n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_"))
        found = "has no attribute" if cls is None else f"has a {type(cls).__name__}, not a class, named"
        raise UserError(f"{where}: module {module.__name__!r} {found} {attr!r}. Fix: name one of its classes: "
                        f"{classes}.")
    try:
        tool = cls(**kwargs)
    except TypeError as err:
        raise UserError(f"{where}: {attr}({_show(kwargs)}) failed: {err}. Fix: pass the arguments it takes.") from err
    except Exception as err:  # the tool's own set-up failed (a file, a service, a sandbox): its words, no traceback
        raise UserError(f"{where}: {attr}({_show(kwargs)}) raised {type(err).__name__}: {err}. Fix: what it says, "
                        "or the tool's arguments (agent.tools[].args); MEGARL_DEBUG=1 shows the traceback.") from err
    lacking = [a for a in ("name", "description") if not (isinstance(getattr(tool, a, None), str) and getattr(tool, a))]
    if not callable(getattr(tool, "run", None)):
        lacking.append("run")
    if lacking:
        raise UserError(
            f"{where}: {attr} is not a tool: it lacks {', '.join(lacking)}. Fix: give the class a non-empty `name` "
            "and `description` (strings) and a method `run(self, call: str) -> str` (plain or async)."
        )
    return tool


def _show(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
