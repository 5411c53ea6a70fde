"""actor:, critic: and reference: how each model trains (optimizer, mini-batches, offload)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megarl.config.checks import positive, within
from megarl.config.lora import LoraConfig


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of a cosine/linear decay."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up to min_lr at the end of the run (trainer.num_steps RL steps). The schedule advances
    once per optimizer step (num_ppo_epochs x rollout batch / mini_batch_size of them per RL step), and not
    for a float16 step the loss scaler skipped."""
    num_warmup_steps: int = 0
    """RL steps of linear warm-up from 0 to lr (that many times the optimizer steps of an RL step)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 = no clipping."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron distributed optimizer)."""

    def __post_init__(self) -> None:
        within(self, "lr", "(0, inf)", "set a positive peak learning rate such as 1e-6")
        within(self, "min_lr", f"[0, {self.lr}]", "set min_lr between 0 and lr")
        within(self, "num_warmup_steps", "[0, inf)", "use 0 for no warm-up")
        within(self, "weight_decay", "[0, inf)", "use 0 to disable weight decay")
        within(self, "adam_beta1", "[0, 1)", "use 0.9")
        within(self, "adam_beta2", "[0, 1)", "use 0.999")
        within(self, "adam_eps", "(0, inf)", "use 1e-8")
        within(self, "clip_grad", "[0, inf)", "use 1.0, or 0 for no clipping")


@dataclass(kw_only=True, slots=True)
class UpdateConfig:
    """How one model (actor or critic) is updated from a rollout batch."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    num_ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int | None = None
    """Samples per optimizer step (all data-parallel ranks together); null = the whole rollout batch."""
    dynamic_batch: bool = True
    """Pack variable-length samples into micro-batches of at most max_tokens_per_gpu tokens."""
    max_tokens_per_gpu: int = 8192
    """Token budget of one micro-batch on one GPU when dynamic_batch is true."""
    micro_batch_size: int = 1
    """Samples per micro-batch on one GPU when dynamic_batch is false."""
    offload_optimizer: bool = True
    """Move the optimizer state (fp32 master weights, Adam moments) to pinned host memory while this model is
    not updating (rollout, scoring, the other model's update), for the engine's KV cache. The gradient buffer
    is freed then either way: every update zeroes it first, so nothing is copied."""

    def optimizer_steps(self, rollout_batch: int) -> int:
        """Optimizer steps per RL step: num_ppo_epochs passes over ``rollout_batch`` samples, one per mini-batch."""
        return self.num_ppo_epochs * (rollout_batch // (self.mini_batch_size or rollout_batch))

    def __post_init__(self) -> None:
        positive(self, "num_ppo_epochs", "max_tokens_per_gpu", "micro_batch_size")
        within(self, "mini_batch_size", "[1, inf)", "set a sample count, or null for one step per epoch")


@dataclass(kw_only=True, slots=True)
class ActorConfig(UpdateConfig):
    """Policy training."""

    offload_weights: bool = True
    """Move the actor's weights (and the hand-over's buffers) to pinned host memory while the engine generates,
    so that the engine's copy is the only one on the GPU and its KV cache gets the room: one copy out after
    each hand-over and one back before scoring."""
    lora: LoraConfig | None = None
    """Low-rank adapters (LoRA) on the actor's linear layers, e.g. {rank: 16, alpha: 32}: the base weights stay
    frozen and only the adapters train (gradients and optimizer state of the adapters only); the reference model
    is the actor with its adapters off (no second copy of the weights), and the engine receives the merged
    weights W + s B A. null (or rank 0) = full fine-tuning. The critic has no adapters."""

    def lora_on(self) -> bool:
        """Whether the actor trains adapters instead of its weights."""
        return self.lora is not None and self.lora.rank > 0

    def adapter_handover(self) -> bool:
        """Whether the engine serves the adapters over its base weights (actor.lora.handover: adapter)."""
        return self.lora is not None and self.lora.rank > 0 and self.lora.handover == "adapter"


@dataclass(kw_only=True, slots=True)
class CriticConfig(UpdateConfig):
    REFUSED_KEYS: ClassVar[dict[str, str]] = {
        "lora": "LoRA adapters train only the actor (actor.lora); the critic is fully fine-tuned. Remove critic.lora."}
    hf_path: str | None = None
    """Critic initialisation (HF dir): a causal LM gives its body under a value head of zeros; a reward model (a
    *ForSequenceClassification with num_labels 1, e.g. one exported by megarl.train_rm) gives its body and its head
    score.weight, so the critic's first values are its scores. Its body must have the policy's shape (checked at
    start-up). null = model.hf_path with a value head of zeros."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Value-model optimizer (a critic learns faster than the policy, hence lr 1e-5)."""
    offload_weights: bool = True
    """Move the critic's weights to host memory outside its own phases (its values and its update)."""


@dataclass(kw_only=True, slots=True)
class ReferenceConfig:
    offload_weights: bool = True
    """Move the reference model's weights to host memory outside the phase that scores with them."""
