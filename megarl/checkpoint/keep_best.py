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

BEST = "best.json"


def best_step(root: Path) -> int | None:
    """The step of the kept best checkpoint in ``root``, if any."""
    path = root / BEST
    if not path.is_file():
        return None
    try:
        return int(json.loads(path.read_text())["step"])
    except (ValueError, KeyError, TypeError):  # a damaged record keeps nothing extra, and rotation goes on
        return None


def mark_best(root: Path, metric: str, step: int, metrics: dict[str, float]) -> bool:
    """After step ``step``'s evaluation: record its checkpoint as the best when it exists and ``metric`` beats
    the recorded best (rank 0 only). Returns whether it did."""
    value = metrics.get(metric)
    if value is None or not math.isfinite(value) or not (root / f"step_{step:06d}").is_dir():
        return False
    path = root / BEST
    try:
        previous = json.loads(path.read_text())["value"] if path.is_file() else -math.inf
    except (ValueError, KeyError, TypeError):
        previous = -math.inf
    if value <= previous:
        return False
    partial = root / f".{BEST}.partial"
    with open(partial, "w") as f:
        json.dump({"metric": metric, "value": value, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    partial.replace(path)
    return True
