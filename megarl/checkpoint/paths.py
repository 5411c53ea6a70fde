"""Names inside checkpoint.dir and which checkpoints it holds: the step_* directories, ``latest``, the rotation."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from megarl.checkpoint.keep_best import best_step

LATEST = "latest"
STOP = "STOP"
OPTIMIZER = "optimizer"
COMMON = "common.pt"
TRAINER = "trainer.json"
STEP_DIR = re.compile(r"step_(\d{6,})")


def checkpoints(root: Path) -> dict[int, Path]:
    """The complete checkpoints in ``root`` by step (never a .tmp or .damaged one)."""
    found = {}
    for path in root.glob("step_*"):
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def rotate(root: Path, keep_last: int, saved: Path) -> None:
    """Keep ``saved`` (just written and checksummed from the disk: the newest verified checkpoint), the
    ``keep_last - 1`` newest before it and the best one (checkpoint.keep_best); delete older ones. Checkpoints
    of later steps (left by a run resumed from an earlier one) are not this run's to delete."""
    step, best = int(saved.name.removeprefix("step_")), best_step(root)
    older = sorted((s for s in checkpoints(root) if s < step), reverse=True)
    for s in [s for s in older[keep_last - 1:] if s != best]:  # checkpoint.keep_best's stays
        shutil.rmtree(root / f"step_{s:06d}", ignore_errors=True)
