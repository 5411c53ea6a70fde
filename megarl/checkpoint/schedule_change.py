"""What a resume with another trainer.num_steps does to a decaying learning rate: the schedule's shape comes from
the config, not the checkpoint (megarl.models.trainable.lr_scheduler), so a cosine or linear decay is re-sized to
the new length and the learning rate jumps at the resumed step. Allowed (a longer run is the same experiment
continued), and said in one line with both rates."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megarl.config.training import OptimizerConfig
from megarl.errors import UserError


def lr_at(optim: OptimizerConfig, num_steps: int, step: int) -> float:
    """The learning rate after ``step`` of ``num_steps`` RL steps: Megatron's schedule as lr_scheduler builds it
    (linear warm-up from 0 over num_warmup_steps, then constant, or a linear or cosine decay to min_lr at
    num_steps). Counted in RL steps: lr_scheduler scales every length by the optimizer steps of an RL step, which
    leaves the ratios the same."""
    warmup = optim.num_warmup_steps
    if warmup and step <= warmup:
        return optim.lr * step / warmup
    if optim.lr_schedule == "constant":
        return optim.lr
    decay = max(num_steps, warmup + 1)
    if step > decay:
        return optim.min_lr
    ratio = (step - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if optim.lr_schedule == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return optim.min_lr + coeff * (optim.lr - optim.min_lr)


def saved_optimizer(saved: dict[str, Any], prefix: str, current: OptimizerConfig) -> OptimizerConfig:
    """The optimizer config under ``prefix`` in a checkpoint's flattened config (``current`` where it has none, or
    one this megarl cannot read)."""
    values = {f.name: saved[f"{prefix}.{f.name}"] for f in dataclasses.fields(current) if f"{prefix}.{f.name}" in saved}
    try:
        return dataclasses.replace(current, **values)
    except (TypeError, ValueError, UserError):
        return current


def resized_schedule(schedules: dict[str, tuple[OptimizerConfig, OptimizerConfig]], saved_steps: object,
                     num_steps: int, saved_step: object) -> str | None:
    """The line to print when resuming the checkpoint of step ``saved_step`` (0-based: ``saved_step + 1`` steps done)
    with ``num_steps`` where its run had ``saved_steps``, for each optimizer (``schedules``: its config field's
    prefix -> its saved config and its config now) whose learning rate changes by it; None when none does, or the
    checkpoint does not say."""
    if not isinstance(saved_steps, int) or not isinstance(saved_step, int) or saved_steps == num_steps:
        return None
    done = saved_step + 1
    moved = [(name, lr_at(old, saved_steps, done), lr_at(new, num_steps, done))
             for name, (old, new) in schedules.items()]
    moved = [(name, a, b) for name, a, b in moved if not math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)]
    if not moved:
        return None
    return (f"megarl: trainer.num_steps {saved_steps} -> {num_steps} re-sizes the learning-rate decay: after {done} "
            "steps " + "; ".join(f"{name}.lr_schedule {schedules[name][1].lr_schedule} gives {b:.3g} where the "
                                   f"saved run had {a:.3g}" for name, a, b in moved)
            + ". To keep the saved run's curve, resume with its trainer.num_steps.")
