"""Where a run's start-up went, printed once after its first step (issue 51 item 2): the parts between the marks set
along setup (megarl.loop.bootstrap, megarl.rollout.factory, megarl/train.py), from the process's own start, and the
first step against a steady one once the second step ends. Each part is the time since the mark before it, so the
parts add up to the total; a mark set again (an engine restarted during start-up) adds to its part."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

_origin: float | None = None
_last: float | None = None
_parts: dict[str, float] = {}
_steps: list[float] = []  # the perf_counter at the end of each step, up to the second
_engine_log: tuple[Path, int] | None = None  # the engine's log and its size when this run's engine started


def process_age() -> float:
    """Seconds since this process started (Linux's /proc: the interpreter's own start-up included), else 0."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def mark(part: str) -> None:
    """End start-up part ``part`` now (its time: since the previous mark, or the process's start)."""
    global _origin, _last
    if _steps:  # start-up is over: an engine restarted mid-run is not start-up
        return
    now = time.perf_counter()
    if _origin is None:
        _origin = _last = now - process_age()
    assert _last is not None
    _parts[part] = _parts.get(part, 0.0) + now - _last
    _last = now


def engine_log(path: Path) -> None:
    """The engine's log, where SGLang reports its CUDA graph captures, as the engine starts. The log is appended to
    by every run in the same directory (a resume, a requeued job): only what it gains from here on is this run's."""
    global _engine_log
    if _engine_log is None or _engine_log[0] != path:  # an engine restarted during start-up: its captures count
        _engine_log = (path, path.stat().st_size if path.is_file() else 0)


def graph_capture_s(text: str) -> float | None:
    """SGLang's CUDA graph captures in its log: each tqdm bar's elapsed time when it reached 100%, summed. tqdm can
    draw a finished bar twice, at its last update and at its close (only the rate differs): the second drawing is
    the same capture (an H100 log counted a 50 s capture as 100 s, more than the engine's whole start)."""
    bars = re.findall(r"(Capturing [^:|]*): 100%\|[^|]*\| *(\d+/\d+) \[(?:(\d+):)?(\d+):(\d+)<", text)
    if not bars:
        return None
    captures = [bar for i, bar in enumerate(bars) if i == 0 or bar != bars[i - 1]]
    return sum(int(h or 0) * 3600 + int(m) * 60 + int(s) for _, _, h, m, s in captures)


def step_ended(aside: float = 0.0) -> dict[str, float]:
    """Called as each step's row is logged: after the first, rank 0 prints where the start-up went and the row gets
    the parts as startup/*_s; after the second, how the first step compared with a steady one. ``aside``: the
    seconds of the step that are not training (its held-out evaluation), left out of that comparison (a 2-step run
    compared its first step with a second that evaluated the held-out sets: "0.7x a steady one")."""
    if len(_steps) >= 2:
        return {}
    if not _steps:
        mark("first step")
        if aside:
            _parts["first step"] -= aside
            _parts["eval after the first step"] = aside
    _steps.append(time.perf_counter())
    rank0 = os.environ.get("RANK", "0") == "0"
    if len(_steps) == 2:
        steady = _steps[1] - _steps[0] - aside
        if rank0 and steady > 0:
            print(f"megarl: the first step took {_parts['first step'] / steady:.1f}x a steady one "
                  f"({_parts['first step']:.1f} s against {steady:.1f} s)", flush=True)
        return {}
    if rank0:
        print(line(), flush=True)
    return {f"startup/{_key(part)}_s": seconds for part, seconds in _parts.items()} | \
        {"startup/total_s": sum(_parts.values())}


def line() -> str:
    graphs = None
    if _engine_log is not None and _engine_log[0].is_file():
        path, start = _engine_log
        with path.open("rb") as f:
            f.seek(start)
            graphs = graph_capture_s(f.read().decode(errors="replace"))
    parts = []
    for part, seconds in _parts.items():
        note = f" (of which SGLang's CUDA graph capture {graphs:.1f} s)" if part == "engine start" and graphs else ""
        parts.append(f"{part} {seconds:.1f} s{note}")
    return f"megarl: start-up {sum(_parts.values()):.1f} s: " + ", ".join(parts)


def _key(part: str) -> str:
    return re.sub(r"\W+", "_", part).strip("_")
