"""Caps on what a tool call puts out: its observation (what the model reads, then tokenizes and generates after)
and what it prints to the trainer's console. One tool returning 6 MB made a step's generation 1000x slower, and
one printing megabytes filled the console, so a call gets `limit` characters of each and the rest is counted and
dropped with one note."""

from __future__ import annotations

import sys
import threading
from contextvars import ContextVar
from typing import Any, TextIO


def cap(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and a note of how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[tool output cut: {len(text) - limit} more characters]"


class PrintBudget:
    """The characters one call may still print; past them, one note and silence."""

    def __init__(self, tool: str, limit: int) -> None:
        self.tool, self.left, self.noted = tool, limit, False

    def take(self, text: str) -> str:
        kept, self.left = text[:max(self.left, 0)], self.left - len(text)
        if self.left >= 0 or self.noted:
            return kept
        self.noted = True
        return f"{kept}\n[megarl: tool {self.tool!r} printed more than it may; the rest of this call's output is " \
               "dropped (agent.tool_output_chars)]\n"


CALL_BUDGET: ContextVar[PrintBudget | None] = ContextVar("megarl_tool_print_budget", default=None)
"""Set for the duration of a tool call: in its thread (sync tools) or its task (async tools)."""


class _CappedStream:
    """sys.stdout/sys.stderr as they were, except that writes made inside a tool call spend its budget."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        budget = CALL_BUDGET.get()
        self._stream.write(text if budget is None else budget.take(text))
        return len(text)  # what the caller wrote counts as written, kept or not

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_installed = threading.Lock()


def cap_console() -> None:
    """Route sys.stdout and sys.stderr through the per-call budgets (once per process; writes outside a call
    pass unchanged). Output written to the file descriptors directly (a subprocess, C code) is not seen."""
    with _installed:
        if not isinstance(sys.stdout, _CappedStream):
            sys.stdout = _CappedStream(sys.stdout)  # type: ignore[assignment]
        if not isinstance(sys.stderr, _CappedStream):
            sys.stderr = _CappedStream(sys.stderr)  # type: ignore[assignment]
