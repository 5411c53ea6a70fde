"""checkpoint.stop_file: a file that asks the run to save and stop after the current step (Slurm time limits,
preemption)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megarl.checkpoint.paths import STOP
from megarl.config import CheckpointConfig


def stop_file(cfg: CheckpointConfig) -> Path | None:
    if cfg.dir is None:
        return None
    return Path(cfg.stop_file) if cfg.stop_file is not None else Path(cfg.dir) / STOP


def stop_requested(cfg: CheckpointConfig, device: torch.device) -> bool:
    """Whether the stop file exists, as rank 0 sees it (every rank must agree: they all save)."""
    path = stop_file(cfg)
    flag = torch.tensor([dist.get_rank() == 0 and path is not None and path.exists()], dtype=torch.int32,
                        device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def acknowledge_stop(cfg: CheckpointConfig, step: int) -> None:
    """After the checkpoint of ``step``: delete the stop file so that the resumed job runs on."""
    path = stop_file(cfg)
    if dist.get_rank() == 0 and path is not None:
        path.unlink(missing_ok=True)
        print(f"megarl: stopped after step {step + 1} as {path} asked; the checkpoint resumes with "
              "checkpoint.resume: auto", flush=True)
