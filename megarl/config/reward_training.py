"""The recipe of `python -m megarl.train_rm`: a reward model trained on preference pairs (Bradley-Terry).

Sections model, parallel, checkpoint and tracking are the RL recipe's own; data, training and trainer are this
command's. docs/reward_models.md shows a recipe."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config.checks import nonempty, positive, seeds, within
from megarl.config.model import ModelConfig, ParallelConfig
from megarl.config.run import CheckpointConfig, TrackingConfig
from megarl.config.training import OptimizerConfig
from megarl.config.yaml_io import FieldError, apply_overrides, build, check, flatten, locate, read_yaml


@dataclass(kw_only=True, slots=True)
class PairsConfig:
    train_path: str
    """Preference pairs (.jsonl or .parquet; megarl.data.preferences): {"prompt", "chosen", "rejected"} as text or
    chat messages, two whole conversations {"chosen", "rejected"}, or token ids {"prompt_ids", "chosen_ids",
    "rejected_ids"}."""
    eval_path: str | None = None
    """Held-out pairs, scored every trainer.eval_every steps (pairwise accuracy, margin); null = none."""
    max_eval_pairs: int | None = None
    """Score at most this many held-out pairs (the first ones); null = all."""
    pairs_per_step: int = 64
    """Pairs per optimizer step (all data-parallel ranks together)."""
    apply_chat_template: bool = True
    """Render each conversation with the tokenizer's chat template (when it has one): the prompt with the
    assistant header, then the response and the EOS token, as the policy's samples look; else plain text."""
    end_with_eos: bool = True
    """End every response with the tokenizer's EOS token, as a sample that stopped reads (and as RL renders one
    again for this reward model); false when the pairs' text carries it where it belongs (pairs made of the
    policy's own samples, some cut by the token budget). A model whose pad_token_id is the EOS never reads it
    (start-up warns)."""
    max_tokens: int = 2048
    """Longest conversation (prompt and response) in tokens; a longer pair stops start-up, unless drop_long."""
    drop_long: bool = False
    """Skip pairs longer than max_tokens (counted at start-up) instead of stopping with an error."""
    shuffle: bool = True
    """Shuffle the training pairs each epoch; false = in file order, as a cycle (every pair is trained on)."""
    seed: int = 0
    """Shuffle seed."""

    def __post_init__(self) -> None:
        nonempty(self, "train_path")
        positive(self, "pairs_per_step", "max_tokens")
        within(self, "max_eval_pairs", "(0, inf)", "use null for all the held-out pairs")


@dataclass(kw_only=True, slots=True)
class RMUpdateConfig:
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Optimizer and learning-rate schedule (one optimizer step per trainer step)."""
    dynamic_batch: bool = True
    """Pack conversations into micro-batches of at most max_tokens_per_gpu tokens."""
    max_tokens_per_gpu: int = 8192
    """Token budget of a micro-batch with dynamic_batch."""
    micro_batch_size: int = 1
    """Conversations per micro-batch without dynamic_batch."""

    def __post_init__(self) -> None:
        positive(self, "max_tokens_per_gpu", "micro_batch_size")


@dataclass(kw_only=True, slots=True)
class RMTrainerConfig:
    num_steps: int = 100
    """Optimizer steps, each over data.pairs_per_step pairs."""
    seed: int = 0
    """Seed of the head's initialisation (from a causal LM) and any other randomness."""
    eval_every: int = 10
    """Score the held-out pairs every this many steps, after the last and before the first; 0 = never."""
    log_every: int = 1
    """Console progress every this many steps (metrics.jsonl gets every step)."""

    def __post_init__(self) -> None:
        positive(self, "num_steps", "log_every")
        seeds(self, "seed")
        within(self, "eval_every", "[0, inf)", "use 0 to never evaluate")


@dataclass(kw_only=True, slots=True)
class RewardTrainingConfig:
    model: ModelConfig
    """The model to start from: a causal LM (its body, with a new scalar head) or a reward model
    (*ForSequenceClassification with one label: body and head)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallel layout."""
    data: PairsConfig
    """Preference pairs."""
    training: RMUpdateConfig = field(default_factory=RMUpdateConfig)
    """Optimizer and micro-batching."""
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)
    """Run length, evaluation, seed."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming, as in RL runs."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment tracking."""

    def __post_init__(self) -> None:
        check(self.checkpoint.keep_best is None, "checkpoint.keep_best", self.checkpoint.keep_best,
              "be null for reward-model training", "remove it (every checkpoint is kept by keep_last)")
        # A resume of reward-model training refuses every change to what its steps trained (megarl.rm.setup)
        check(not self.checkpoint.allow_changes, "checkpoint.allow_changes", self.checkpoint.allow_changes,
              "be null for reward-model training, which resumes only the experiment it saved",
              "remove it; to train on other data or settings, start a new checkpoint.dir")
        warmup = self.training.optimizer.num_warmup_steps
        check(warmup < self.trainer.num_steps, "training.optimizer.num_warmup_steps", warmup,
              f"be below trainer.num_steps ({self.trainer.num_steps}): the learning rate would never reach "
              "training.optimizer.lr", "shorten the warm-up (a few per cent of the run), or use 0")

    def to_flat_dict(self) -> dict[str, Any]:
        """Dotted keys to values, as mlflow's parameters and a checkpoint's record take them."""
        return flatten(dataclasses.asdict(self))


def load_reward_training(path: str | Path, overrides: Sequence[str] = ()) -> RewardTrainingConfig:
    """Read a reward-model recipe, apply `--set` overrides, and return it checked; errors name the dotted key and
    where it was written."""
    data, origins = read_yaml(path)
    located = dict(origins)
    merged = apply_overrides(dict(data), overrides, located)
    try:
        return build(RewardTrainingConfig, merged)
    except FieldError as err:
        raise locate(err, located) from None
