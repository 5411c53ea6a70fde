"""``train.py --profile STEP``: a torch profiler trace of one RL step (generation, scoring, updates and the
hand-over), one Chrome trace per rank in the run directory; open it in Perfetto or chrome://tracing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from megarl.errors import UserError


def check_profile_step(step: int | None, first: int, end: int) -> None:
    """A user error unless ``step`` (if given) is one of the steps this run does, ``first`` to ``end - 1``."""
    if step is not None and not first <= step < end:
        raise UserError(f"--profile {step}: this run does steps {first} to {end - 1} (trainer.num_steps = {end}"
                        + (f", resuming at step {first}" if first else "") + "); name one of them.")


def trace_path(out_dir: Path, step: int, rank: int) -> Path:
    return out_dir / f"profile_step{step}_rank{rank}.json"


@contextmanager
def profiled(active: bool, path: Path) -> Iterator[None]:
    """Trace the block into ``path`` when ``active`` (CPU and, on GPUs, CUDA activity); else do nothing."""
    if not active:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as profile:
        yield
    partial = path.with_name(path.name + ".tmp")  # a crash while writing leaves no truncated trace
    profile.export_chrome_trace(str(partial))
    os.replace(partial, path)
    print(f"megarl: profile trace written to {path}", flush=True)
