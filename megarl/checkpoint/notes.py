"""Start-up lines about checkpointing that a long run would otherwise learn of only when it needs a checkpoint."""

from __future__ import annotations

from megarl.config import Config

LONG_RUN_STEPS = 20
"""A run of this many steps or more without periodic checkpoints is warned about."""


def no_checkpoint_note(cfg: Config) -> str | None:
    """checkpoint.save_every = 0 (the default) saves only when a stop file asks (a Slurm time limit): a crash, a
    preemption or a node failure restarts such a run from step 0, and its end leaves no weights to export."""
    if cfg.checkpoint.save_every or cfg.trainer.num_steps < LONG_RUN_STEPS:
        return None
    if cfg.checkpoint.dir is None:
        return (f"megarl: warning: checkpoint.dir is null: this run of {cfg.trainer.num_steps} steps keeps no "
                "checkpoint, so a crash, a preemption or a node failure restarts it from step 0, and its end leaves "
                "no weights to export. Fix: set checkpoint.dir and checkpoint.save_every (for example 20).")
    return (f"megarl: warning: checkpoint.save_every = 0: this run of {cfg.trainer.num_steps} steps saves no "
            "checkpoint (only a stop file, such as the Slurm launchers' before the time limit, makes one), so a "
            "crash, a preemption or a node failure restarts it from step 0, and its end leaves no weights to export. "
            "Fix: set checkpoint.save_every (for example 20; checkpoint.keep_last bounds the disk it takes).")
