"""checkpoint.keep_best: the checkpoint whose weights scored best on a held-out metric stays outside rotation.

``best.json`` in checkpoint.dir names it: {"metric", "value", "step"}. A step's checkpoint and its evaluation
hold the same weights (both come after that step's update), so a step both saved and evaluated can become
the best; megarl.checkpoint.rotate never deletes the step ``best.json`` names.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from megarl.errors import UserError

BEST = "best.json"


def read_best(root: Path) -> dict[str, Any] | None:
    """``best.json`` in ``root`` ({"metric", "value", "step"}), None without one; a damaged one is an error, as
    rotation would delete the real best with it taken for none."""
    path = root / BEST
    if not path.is_file():
        return None
    try:
        best = json.loads(path.read_text())
        if not (isinstance(best, dict) and isinstance(best.get("metric"), str) and isinstance(best.get("step"), int)
                and isinstance(best.get("value"), int | float)):
            raise ValueError(f"not {{metric, value, step}}: {str(best)[:80]}")
    except ValueError as err:
        raise UserError(f"{path} is damaged ({err}), so the best checkpoint it should name is unknown and rotation "
                        "could delete it. Fix: write it again as {\"metric\": ..., \"value\": ..., \"step\": N} "
                        "naming the best step_N in that directory, or delete it to keep no best.") from None
    return best


def best_step(root: Path) -> int | None:
    """The step of the kept best checkpoint in ``root``, if any."""
    best = read_best(root)
    return None if best is None else int(best["step"])


def mark_best(root: Path, metric: str, step: int, metrics: dict[str, float]) -> bool:
    """After step ``step``'s evaluation: record its checkpoint as the best when it exists and ``metric`` beats
    the recorded best (rank 0 only). Returns whether it did."""
    value = metrics.get(metric)
    if value is None or not math.isfinite(value) or not (root / f"step_{step:06d}").is_dir():
        return False
    best = read_best(root)
    if best is not None and value <= best["value"]:
        return False
    write_best(root, metric, value, step)
    return True


def write_best(root: Path, metric: str, value: float, step: int) -> None:
    """Replace ``best.json`` atomically: a crash leaves the old one or the new one, never half of one."""
    partial = root / f".{BEST}.partial"
    with open(partial, "w") as f:
        json.dump({"metric": metric, "value": value, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    partial.replace(root / BEST)
