"""At start-up: ``best.json`` (checkpoint.keep_best) against the checkpoints the run goes on from.

One that names a step this run trains again (its checkpoint was damaged and passed over, or the run starts anew)
or a checkpoint no longer there is set aside, and the best is rebuilt from the scores metrics.jsonl recorded for
the checkpoints left, the best of them verified first. Without that rebuild, no checkpoint was the best any more:
the next save's rotation deleted the real best, and a worse step was announced as the best so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megarl.checkpoint.keep_best import BEST, read_best, write_best
from megarl.checkpoint.paths import checkpoints
from megarl.checkpoint.resuming import set_aside, verify
from megarl.distributed.rank0 import from_rank0
from megarl.errors import UserError
from megarl.run.tracking import read_jsonl_rows


@dataclass(frozen=True, slots=True)
class _Forgotten:
    line: str
    """What was set aside, and why."""
    metric: str
    scores: list[tuple[int, float]]
    """(step, recorded value) of the checkpoints left, best first."""


def check_best(root: Path, metric: str | None, start_step: int, rank: int) -> None:
    """``best.json`` must be about checkpoint.keep_best's ``metric`` (values of two metrics do not compare). One
    naming a step from ``start_step`` on, or a checkpoint that is gone, is moved to best.json.stale and the best
    rebuilt, with a line. Rank 0 decides, so that no rank reads best.json while it moves; every rank takes part in
    the verification (collective)."""
    found = from_rank0(lambda: _forget_stale(root, metric, start_step), rank)
    if isinstance(found, str):
        raise UserError(found)
    if found is None:
        return
    if metric is None:  # no record is kept: nothing to rebuild, and a rebuilt one would spare its step forever
        if rank == 0:
            print(f"{found.line}; checkpoint.keep_best is off, so no best is rebuilt", flush=True)
        return
    for step, value in found.scores:
        path = root / f"step_{step:06d}"
        problem = verify(path)
        if problem is None:
            if rank == 0:
                write_best(root, found.metric, value, step)
                print(f"{found.line}; the best is now step {step} ({found.metric} = {value}), the best score "
                      "metrics.jsonl holds of the checkpoints left", flush=True)
            return
        if rank == 0:
            print(f"megarl: {path.name}, the best left on {found.metric} ({value}), is damaged ({problem}); kept as "
                  f"{set_aside(path)}, not as the best", flush=True)
    if rank == 0:
        print(f"{found.line}; no checkpoint left has a score of {found.metric} in metrics.jsonl, so the best is "
              "recorded anew", flush=True)


def _forget_stale(root: Path, metric: str | None, start_step: int) -> _Forgotten | str | None:
    """Rank 0: set a stale best.json aside; the scores to rebuild the best from, or the error every rank raises."""
    try:
        best = read_best(root)
        if best is None:
            return None
        if metric is not None and best["metric"] != metric:
            return (f"{root / BEST} names the best checkpoint on {best['metric']!r}, but checkpoint.keep_best = "
                    f"{metric!r}: values of two metrics do not compare, and the best would be mislabelled or "
                    f"deleted. Fix: set checkpoint.keep_best back to {best['metric']!r}, or move {BEST} away to "
                    f"start a new record (step {best['step']}'s checkpoint then rotates like any other).")
        step = best["step"]
        if step < start_step and (root / f"step_{step:06d}").is_dir():
            return None
        scores = _recorded(root, best["metric"], start_step) if metric is not None else []
    except UserError as err:
        return str(err)
    (root / BEST).replace(root / f"{BEST}.stale")
    why = "this run trains that step again" if step >= start_step else "that checkpoint is gone"
    return _Forgotten(f"megarl: {BEST} named step {step} ({best['metric']} = {best['value']}) as the best, but {why}; "
                      f"it is forgotten (moved to {BEST}.stale)", best["metric"], scores)


def _recorded(root: Path, metric: str, start_step: int) -> list[tuple[int, float]]:
    """The checkpoints before ``start_step`` with a finite ``metric`` in metrics.jsonl, best first (the earliest of
    equals, as mark_best keeps it). Rows from ``start_step`` on belong to steps this run trains again."""
    path = root / "metrics.jsonl"
    if not path.is_file():
        return []
    rows, _ = read_jsonl_rows(path, [line for line in path.read_text().splitlines() if line.strip()])
    saved = checkpoints(root)
    values = {row["step"]: row[metric] for row in rows
              if row["step"] < start_step and row["step"] in saved and isinstance(row.get(metric), int | float)
              and math.isfinite(row[metric])}
    return sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
