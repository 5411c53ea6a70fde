"""Range and form checks shared by the config sections (one error naming field, value and fix)."""

from __future__ import annotations

import re

from megarl.config.yaml_io import check

IMPORT_PATH_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
INTERVAL_RE = re.compile(r"([\[(])(\S+), (\S+)([\])])")


def within(section: object, name: str, interval: str, fix: str) -> None:
    """Check that field `name` lies in `interval`, written "(0, 1]" or "[1, inf)"; null always passes
    (only optional fields can be null once loaded)."""
    value = getattr(section, name)
    match = INTERVAL_RE.fullmatch(interval)
    assert match, f"bad interval {interval!r}"
    left, low, high, right = match.groups()
    if value is None:
        return
    above = value > float(low) if left == "(" else value >= float(low)
    below = value < float(high) if right == ")" else value <= float(high)
    finite = " a finite number" if abs(value) == float("inf") else ""
    must = f"be{finite} {'>' if left == '(' else '>='} {low}" if high == "inf" else f"be in {interval}"
    check(above and below, name, value, must, fix)


SEED_RANGE = "[0, 2147483647]"
"""Seeds megarl takes: every engine's seed fits (vLLM's is below 2^32), and the per-step seeds derived from them
(a seed plus the step times a stride) stay far inside 64 bits."""


def seeds(section: object, *names: str) -> None:
    for name in names:
        within(section, name, SEED_RANGE, "use a seed such as 0")


def positive(section: object, *names: str) -> None:
    for name in names:
        within(section, name, "[1, inf)", f"set `{name}` to a positive integer")


def nonempty(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        check(bool(value.strip()), name, value, "be non-empty", f"set `{name}`")
