"""Tools for agentic (multi-turn, tool-using) rollouts: the interface and its loader (base.py), a pool that runs
calls concurrently (pool.py), and the built-ins: a calculator and a sandboxed Python executor."""

from megarl.tools.base import Tool, ToolOutput, load_tool
from megarl.tools.pool import ToolPool, ToolResult

__all__ = ["Tool", "ToolOutput", "ToolPool", "ToolResult", "load_tool"]
