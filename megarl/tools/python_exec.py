"""A tool that runs model-written Python in the sandbox and shows the model its output."""

from __future__ import annotations

import json
from typing import Any

from megarl.tools.base import Status, ToolOutput
from megarl.tools.sandbox import SandboxConfig, require_isolation, run_python


class PythonExecutor:
    """Runs each call as a Python script in a fresh sandbox (sandbox.py); the observation is its stdout+stderr,
    truncated, and how it ended when not normally. Keyword arguments are SandboxConfig fields; a machine that
    cannot isolate the code is refused here, when the trainer starts (UserError naming the fix)."""

    name = "python"
    description = (
        "Runs a Python 3 script and returns what it prints (stdout and stderr). Each call starts fresh: no state, "
        "files or network; print the values you need."
    )

    def __init__(self, **config: Any) -> None:
        self.config = SandboxConfig(**config)
        require_isolation(self.config)

    def run(self, call: str) -> ToolOutput:
        result = run_python(script(call), self.config)
        status: Status
        if result.end.startswith("timeout"):
            status = "timeout"
        elif result.end == "ok":
            status = "ok"
        else:
            status = "error"
        # Not the program's doing: the sandbox could not run it, or processes outlived the call (a bug).
        broken = result.end.startswith("sandbox failed") or bool(result.survivors)
        return ToolOutput(text=result.observation, status=status,
                          metadata={"end": result.end, "isolation": result.layers, "sandbox_failed": broken,
                                    "truncated_bytes": result.truncated_bytes, "survivors": result.survivors})


def script(call: str) -> str:
    """The call's program. Chat templates with a tool format write a call's arguments as an object, e.g. Qwen's
    {"name": "python", "arguments": {"code": "print(1)"}}, which reaches the tool as JSON text: as a program, a dict
    literal that prints nothing ("(no output)", status ok). An object of one string is that string."""
    try:
        parsed = json.loads(call)
    except ValueError:
        return call
    if isinstance(parsed, dict) and len(parsed) == 1 and isinstance(value := next(iter(parsed.values())), str):
        return value
    return call
