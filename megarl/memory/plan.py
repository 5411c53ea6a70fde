"""The per-GPU memory plan of a run: what each phase of a step holds on the busiest GPU, checked before
any model is built, so that a config that cannot fit stops with numbers instead of a SIGKILL.

Trainer tensors come from the model's shape and the layout: bf16/fp16 weights (2 B per parameter), an
fp32 gradient buffer (4 B), Adam's fp32 master weights and two moments (12 B, 8 B in fp32 training,
divided over data-parallel ranks with the distributed optimizer); activations of one micro-batch: what each
layer keeps per token for its backward pass, counted tensor by tensor for these models (``layer_activations``:
gated MLPs keep three times their width, unlike the 4h GeLU MLP of Korthikanti et al. 2022's 34 B per hidden
unit; attention keeps no score matrix, since TE's and megarl's kernels are fused; with recomputation only each
layer's input is kept); logits of one micro-batch with the float32 copies that log-probabilities and entropy
need (with ``model.logprob_chunk_tokens``, those of one chunk of tokens). What megarl.memory.offload moves away in a
phase is not counted in it.

The engine: SGLang fills ``rollout.gpu_memory_fraction`` of the memory free when it starts (weights
and KV cache; measured on an H200: 0.7 of the free memory plus about 2 GiB); vLLM takes that fraction
of the whole GPU. Asleep, an engine keeps its CUDA context and some buffers. Overheads: the CUDA
context, NCCL's buffers and the caching allocator's fragmentation, measured at 10-13 GiB over the
trainer's tensors on one H200 and 5 GiB more on two (benchmarks/results/h200/colocation).

With rollout.weight_dtype fp8 (SGLang) the engine's linear layers hold one byte per weight and a float32 scale per
block of rollout.fp8_block x rollout.fp8_block, and the hand-over's quantization holds its staging arena, scratch
buffer and FP8 output on the trainer's side while it runs (``fp8_handover``, from the hand-over's own plan).

Host memory: what megarl.memory.offload moves away lands in pinned host buffers that are kept for reuse, so a
node holds every offloaded part of every local rank at once, next to each process's own memory. A node
without room is refused before launch too (one H200 host of 128 GiB was OOM-killed that way).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from megarl.config import Config, UpdateConfig
from megarl.config.lora import LoraConfig
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.lora.training import adapter_params_per_rank, merged_params_per_rank
from megarl.models.spec import ModelSpec, load_spec
from megarl.reshard.aliasing import aliases_weights

GIB = 2**30
ENGINE_OVERHEAD = 2 * GIB
"""Beyond the fraction, while awake (activations, sampler buffers)."""
ENGINE_ASLEEP = 4 * GIB
"""What a sleeping engine keeps on its GPU (CUDA context, buffers the memory saver does not release)."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per element of each model.dtype."""
TRAINER_OVERHEAD = 2 * GIB
"""CUDA context of the trainer process."""
NCCL_OVERHEAD = 5 * GIB
"""NCCL communicators' buffers (allocated outside torch) when the trainer spans several GPUs: measured
5 GiB on two H200s joined by NVLink (TP2 trainer, TP1 engines)."""
FRAGMENTATION = 0.10
"""Share of the trainer's tensors the caching allocator holds on top of them."""
MARGIN = 0.03
"""Share of the GPU a plan leaves free."""
HOST_PER_GPU = 7 * GIB
"""Host memory of the processes on one GPU beyond the offload buffers: a trainer rank (torch, megatron-core,
CUDA's host state, data) and its engine's scheduler. Measured 6.4-7.0 GiB on an H200 node (SGLang TP1
engines; benchmarks/results/h200/colocation/*_tp2*.host_mib.txt)."""
HOST_MARGIN = 0.10
"""Share of the node's memory a plan leaves to the system and page cache."""


@dataclass(frozen=True)
class ModelState:
    """One model's bytes on the busiest GPU."""

    weights: int
    grads: int = 0
    optimizer: int = 0
    """After the first step (Adam's moments are created lazily)."""
    optimizer_at_start: int = 0
    """Before it: the fp32 master weights only."""
    step_scratch: int = 0
    """Temporaries of an Adam step (torch's foreach Adam makes about one fp32 copy of the shard)."""


@dataclass
class MemoryPlan:
    """Per phase, the bytes of each component on the busiest GPU."""

    gpu_bytes: int
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    engine_fraction: float = 0.0
    """rollout.gpu_memory_fraction as the engine gets it (``auto`` resolved)."""
    engine_share: int = 0
    """Bytes that fraction gives a colocated engine for its weights and KV cache (0: engines apart)."""
    engine_floor: int = 0
    """The least share the engine starts with: its weights not mapped from the actor's, one sequence's KV cache."""
    host: dict[str, int] = field(default_factory=dict)
    """Pinned host bytes per GPU, by offloaded part (after the first step, when Adam's moments exist)."""

    def host_bytes(self) -> int:
        return sum(self.host.values())

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    def table(self) -> str:
        """One line per phase: its total and its three largest parts, in GiB."""
        lines = []
        for phase, parts in self.phases.items():
            top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
            lines.append(f"{phase} {self.total(phase) / GIB:.1f} GiB ("
                         + ", ".join(f"{k} {v / GIB:.1f}" for k, v in top) + ")")
        return "; ".join(lines)


def busiest_stage_params(spec: ModelSpec, dims: ParallelDims, vocab_pad_multiple: int, critic: bool = False) -> int:
    """Parameters on the GPU of the busiest pipeline stage: its layers' TP shards (MoE experts: their TP x EP
    shards) plus the embedding or output layer it holds (norms are replicated)."""
    h = spec.hidden_size
    layer = (spec.layer_params() - spec.expert_params() - 2 * h) // dims.tp + 2 * h + layer_expert_params(spec, dims)
    layers = -(-spec.num_layers // dims.pp) * layer
    vocab = spec.padded_vocab_size(dims.tp, vocab_pad_multiple) * h // dims.tp
    head = h if critic else (vocab if (dims.pp > 1 or not spec.tie_word_embeddings) else 0)
    if dims.pp == 1:
        return layers + vocab + head + h
    return layers + max(vocab, head + h)


def layer_expert_params(spec: ModelSpec, dims: ParallelDims) -> int:
    """One layer's MoE expert parameters on one GPU (split over TP x EP; 0 for a dense model)."""
    return spec.expert_params() // (dims.tp * dims.ep)


def stage_expert_params(spec: ModelSpec, dims: ParallelDims) -> int:
    """MoE experts' parameters on one GPU of the busiest pipeline stage."""
    return -(-spec.num_layers // dims.pp) * layer_expert_params(spec, dims)


def model_state(params: int, dtype_bytes: int, trained: bool, dp: int, distributed: bool, expert_params: int = 0,
                ep: int = 1) -> ModelState:
    """``expert_params`` of ``params`` are MoE experts, whose optimizer state a distributed optimizer shards over
    their expert-data-parallel ranks (dp / ep) instead of dp."""
    if not trained:
        return ModelState(weights=params * dtype_bytes)
    master = 0 if dtype_bytes == 4 else 4  # fp32 training updates the weights themselves

    def sharded(per_param: int) -> int:
        if not distributed:
            return params * per_param
        return (params - expert_params) * per_param // dp + expert_params * per_param // (dp // ep)

    return ModelState(weights=params * dtype_bytes, grads=params * 4, optimizer=sharded(master + 8),
                      optimizer_at_start=sharded(master), step_scratch=sharded(4))


def lora_state(full: ModelState, spec: ModelSpec, lora: LoraConfig, dims: ParallelDims, dtype_bytes: int,
               distributed: bool) -> ModelState:
    """A LoRA actor's state: ``full``'s weights (frozen), plus the adapters and the hand-over's merged copies of the
    adapted weights (megarl.lora.training); gradients and optimizer state of the adapters only."""
    adapters = adapter_params_per_rank(spec, lora, dims.tp, dims.pp)
    trained = model_state(adapters, dtype_bytes, True, dims.dp, distributed)
    merged = merged_params_per_rank(spec, lora, dims.tp, dims.pp) * dtype_bytes
    return dataclasses.replace(trained, weights=full.weights + trained.weights + merged)


def layer_activations(spec: ModelSpec, tp: int, sequence_parallel: bool) -> float:
    """Elements one token keeps in one layer for the backward pass, on one TP rank: the inputs of both norms and
    of the QKV and first MLP linears (hidden size each; split over TP only with sequence parallelism), the QKV
    output, the rotated query and key, the query, key and value in the fused attention kernel's layout, the
    attention output twice (the fused kernel's, and the output projection's input, a copy), and per MLP unit
    (TP-split) the gate, its SiLU and the up projection plus the second linear's input. An MoE layer runs that MLP
    in each of the top-k experts a token goes to, on a dispatched copy of the token. Measured on an H200 with the
    local layers (benchmarks/results/h200/update_memory): within 5% for SmolLM2 and Llama-3-8B's body."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_kv_heads * d
    replicated = 4 * h
    split = (q + 2 * kv) + (q + kv) + (q + 2 * kv) + 2 * q
    if spec.is_moe:
        k = spec.num_experts_per_tok
        split += k * (h + 4 * spec.moe_intermediate_size)
    else:
        split += 4 * spec.intermediate_size
    return (replicated + split) / tp if sequence_parallel else replicated + split / tp


def stages_in_flight(dims: ParallelDims) -> float:
    """How many micro-batches' activations of its whole stage the first pipeline stage holds at its peak. 1F1B: PP.
    Interleaved over V virtual chunks (Megatron's schedule, micro-batches grouped by PP): PP * (V + 1) - 1 chunk
    forwards of 1 / V of the stage's layers each, 1.25x the activations of 1F1B at PP 2 and V 2."""
    v = dims.vpp or 1
    return dims.pp if v == 1 else (dims.pp * (v + 1) - 1) / v


def activation_bytes(spec: ModelSpec, cfg: Config, section: UpdateConfig, dims: ParallelDims,
                     entropy: bool, logits: bool = True, segment_mask: bool = False) -> int:
    """One micro-batch of training (forward and backward) on the busiest GPU; ``segment_mask``: packed rows carry a
    block-causal mask (the local layers' packing)."""
    width = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
    tokens = section.max_tokens_per_gpu if section.dynamic_batch else section.micro_batch_size * width
    h, tp = spec.hidden_size, dims.tp
    sp = cfg.parallel.sequence_parallel
    dtype = DTYPE_BYTES[cfg.model.dtype]
    layer = int(tokens * layer_activations(spec, tp, sp) * dtype)
    layers = -(-spec.num_layers // dims.pp)
    if cfg.model.recompute_activations:
        kept = layers * tokens * dtype * h // (tp if sp else 1) + layer
    else:
        kept = layers * layer
    in_flight = stages_in_flight(dims)
    vocab = spec.padded_vocab_size(tp, cfg.model.vocab_pad_multiple) // tp
    chunk = cfg.model.logprob_chunk_tokens
    if not logits:
        logit_bytes = tokens * 4
    elif chunk:
        # One chunk's logits at a time (model dtype, float32, exp, gradient; the entropy rides along), per token a
        # few float32 statistics and the gathered output-layer input, and unless LoRA freezes the weight its
        # gradient: the float32 sum and the copy in the model's dtype it returns (none in float32).
        weight_grad = 0 if cfg.actor.lora_on() else vocab * h * (4 + (dtype if dtype != 4 else 0))
        logit_bytes = min(tokens, chunk) * vocab * (dtype + 4 + 4 + 4) + tokens * (h * dtype + 48) + weight_grad
    else:
        # The logits, their float32 copy and its exponent, and their gradient in the model's dtype.
        logit_bytes = tokens * vocab * ((2 + 4 + 4 + 2) + (8 if entropy else 0))
    # Without Transformer Engine a token budget's packed row carries its block-causal mask: one byte per pair of its
    # tokens (megarl.models.attention.block_causal_mask), which measured 3.5 GiB more at 61k tokens on an H200.
    mask = tokens * tokens if segment_mask and section.dynamic_batch else 0
    return int(kept * in_flight) + logit_bytes + mask


def plan_memory(cfg: Config, spec: ModelSpec, dims: ParallelDims, gpu_bytes: int) -> MemoryPlan:
    """Bytes per phase on the busiest GPU, given what megarl.memory.offload moves away (the config's offload_*
    flags)."""
    dtype = DTYPE_BYTES[cfg.model.dtype]
    algo = cfg.algorithm

    def state(critic: bool, trained: bool, section: UpdateConfig | None) -> ModelState:
        params = busiest_stage_params(spec, dims, cfg.model.vocab_pad_multiple, critic=critic)
        distributed = section is not None and section.optimizer.use_distributed_optimizer
        return model_state(params, dtype, trained, dims.dp, distributed, stage_expert_params(spec, dims), dims.ep)

    actor = state(False, True, cfg.actor)
    if cfg.actor.lora is not None and cfg.actor.lora_on():  # the base frozen: adapters' grads and optimizer only
        actor = lora_state(actor, spec, cfg.actor.lora, dims, dtype, cfg.actor.optimizer.use_distributed_optimizer)
    aliased = aliases_weights(cfg, spec, dims)  # that share of the engine's weights is the actor's memory
    weights_leave = cfg.actor.offload_weights and not aliased
    critic = state(True, True, cfg.critic) if algo.name == "ppo" else None
    # A LoRA actor's reference is the actor with its adapters off: no weights of its own.
    reference = state(False, False, None) if algo.kl_coef > 0 and not cfg.actor.lora_on() else None
    teacher_spec = load_spec(cfg.distill.teacher) if cfg.distill.teacher is not None else None
    teacher = None if teacher_spec is None else model_state(
        busiest_stage_params(teacher_spec, dims, cfg.model.vocab_pad_multiple), dtype, False, dims.dp, False,
        stage_expert_params(teacher_spec, dims), dims.ep)
    rm_spec = reward_spec(cfg)
    reward_model = None if rm_spec is None else model_state(  # frozen, with a scalar head in place of the LM head
        busiest_stage_params(rm_spec, dims, cfg.model.vocab_pad_multiple, critic=True), dtype, False, dims.dp, False,
        stage_expert_params(rm_spec, dims), dims.ep)

    def resident(phase: str, started: bool = True) -> dict[str, int]:
        """Trainer tensors kept on the device in ``phase`` (what the offload flags let leave, leaves)."""
        optimizer = actor.optimizer if started else actor.optimizer_at_start
        parts = {}
        if phase != "generate" or not weights_leave:
            parts["actor weights"] = actor.weights
        if phase == "actor_update":
            parts["actor grads"] = actor.grads
        if phase == "actor_update" or not cfg.actor.offload_optimizer:
            parts["actor optimizer"] = optimizer
        if critic is not None:
            critic_opt = critic.optimizer if started else critic.optimizer_at_start
            if phase in ("values", "critic_update") or not cfg.critic.offload_weights:
                parts["critic weights"] = critic.weights
            if phase == "critic_update":
                parts["critic grads"] = critic.grads
            if phase == "critic_update" or not cfg.critic.offload_optimizer:
                parts["critic optimizer"] = critic_opt
        if reference is not None and (phase == "reference" or not cfg.reference.offload_weights):
            parts["reference weights"] = reference.weights
        if teacher is not None and (phase == "teacher" or not cfg.distill.offload_weights):
            parts["teacher weights"] = teacher.weights
        if reward_model is not None and (phase == "reward_model" or not cfg.reward_model.offload_weights):
            parts["reward model weights"] = reward_model.weights
        return parts

    # Hand-over buffers: SGLang copies in the engine from the actor's tensors, plus a landing buffer for the
    # engine bytes other GPUs hold (one round of them: rollout.landing_buffer_mb); vLLM gets whole engine-layout
    # tensors. Where the actor's weights leave (actor.offload_weights, unaliased), all of them go after each
    # hand-over.
    model = spec.num_params() * dtype
    engine_rank = model // cfg.rollout.tensor_parallel
    if cfg.rollout.engine == "sglang":
        landing = max(0, engine_rank - model // (dims.tp * dims.pp))
        if cfg.rollout.landing_buffer_mb:
            landing = min(landing, cfg.rollout.landing_buffer_mb * 2**20)
    else:
        landing = engine_rank
    if cfg.async_rl.engine_gpus:  # engines apart: the bytes go straight to their GPUs
        landing = 0
    # staging for bytes that cross GPUs: two send buffers where SGLang copies in the engine, four otherwise
    # (Resharder.bind)
    buckets = 2 if cfg.rollout.engine == "sglang" and not cfg.async_rl.engine_gpus else 4
    pool = buckets * cfg.rollout.reshard_bucket_mb * 2**20 if landing or cfg.async_rl.engine_gpus else 0
    fp8 = fp8_handover(cfg, spec, dims, dtype)
    if fp8 is not None:
        engine_rank = fp8.engine_bytes

    def buffers(phase: str) -> dict[str, int]:
        # Where the actor's weights leave, WeightSync.push frees them (Resharder.release, the engine-layout tensors)
        # after every hand-over: they exist in its phase alone. Otherwise they stay bound from one hand-over to the
        # next, through every phase.
        if phase != "handover" and weights_leave:
            return {}
        parts = {"hand-over buffers": landing + pool}
        if fp8 is not None and fp8.buffer_bytes:
            parts["FP8 quantization buffers"] = fp8.buffer_bytes
        return parts

    def with_overhead(parts: dict[str, int], phase: str = "", bound: bool = True) -> dict[str, int]:
        """``parts`` with the trainer's overhead, and the hand-over's buffers where they are ``bound``."""
        parts = parts | buffers(phase) if bound else parts
        tensors = sum(parts.values())
        nccl = NCCL_OVERHEAD if dims.world_size > 1 else 0
        return parts | {"trainer overhead": TRAINER_OVERHEAD + nccl + int(FRAGMENTATION * tensors)}

    plan = MemoryPlan(gpu_bytes)
    entropy = algo.entropy_coef > 0
    te = cfg.model.transformer_engine
    masked = te == "off" or (te == "auto" and (importlib.util.find_spec("transformer_engine") is None
                                              or cfg.actor.lora_on()))  # LoRA adapts the local layers only
    # The trainer's phases first, without the engine: async_rl separate's engine never sleeps, so its auto share
    # is what the trainer's busiest phase leaves.
    plan.phases["actor_update"] = with_overhead(resident("actor_update") | {
        "activations or optimizer step": max(activation_bytes(spec, cfg, cfg.actor, dims, entropy,
                                                              segment_mask=masked), actor.step_scratch)})
    if critic is not None:
        plan.phases["critic_update"] = with_overhead(resident("critic_update") | {
            "activations or optimizer step": max(activation_bytes(spec, cfg, cfg.critic, dims, False, logits=False,
                                                                  segment_mask=masked), critic.step_scratch)})
    if teacher_spec is not None:  # a larger teacher's scoring can be the peak: bounded by a training micro-batch's
        plan.phases["teacher"] = with_overhead(resident("teacher") | {"scoring activations (bound)": activation_bytes(
            teacher_spec, cfg, cfg.actor, dims, False, segment_mask=masked)})
    if rm_spec is not None:  # scored in the actor's micro-batches, without grads: bounded by a training one's
        plan.phases["reward_model"] = with_overhead(resident("reward_model") | {
            "scoring activations (bound)": activation_bytes(rm_spec, cfg, cfg.actor, dims, False, logits=False,
                                                            segment_mask=masked)})
    plan.phases["handover"] = with_overhead(resident("handover"), "handover")
    # The engine sizes itself when it starts: next to what the trainer holds before any step, and before the
    # hand-over's buffers are bound (WeightSync.connect, after the engine's start), so it takes its share of those
    # bytes too.
    at_start = sum(with_overhead(resident("generate", started=False), bound=False).values())
    separate = cfg.async_rl.mode == "separate"
    apart = cfg.async_rl.engine_gpus > 0
    # What the trainer holds beside the awake engine: while generating after the first step (Adam's moments too
    # where the optimizer stays on the GPU; auto sized on the start alone left no room for them), or, async_rl
    # separate, in its busiest phase.
    beside = max(sum(parts.values()) for parts in plan.phases.values()) if separate else \
        sum(with_overhead(resident("generate"), "generate").values())
    if cfg.reward_model.judge is not None:  # started after the engine, asleep beside it from then on
        beside += ENGINE_ASLEEP
    # engines apart size themselves on GPUs of their own
    plan.engine_fraction = resolved_fraction(cfg, gpu_bytes, 0, 0) if apart else \
        resolved_fraction(cfg, gpu_bytes, at_start, beside)
    if apart:
        plan.phases["generate"] = with_overhead(resident("generate"), "generate")
        return _with_host(plan, resident)
    if cfg.rollout.engine == "sglang":
        engine = int(plan.engine_fraction * (gpu_bytes - at_start)) + ENGINE_OVERHEAD
    else:
        engine = int(plan.engine_fraction * gpu_bytes)
    # The engine's share must hold the weights it does not map from the actor's memory and one whole sequence's
    # KV cache: an engine given less fails at its start, after the trainer's models are built.
    kv_heads = max(1, spec.num_kv_heads // cfg.rollout.tensor_parallel)
    sequence = 2 * spec.num_layers * kv_heads * spec.head_dim * dtype * (cfg.rollout.max_prompt_tokens
                                                                           + cfg.rollout.max_new_tokens)
    plan.engine_share = engine - (ENGINE_OVERHEAD if cfg.rollout.engine == "sglang" else 0)
    plan.engine_floor = int(engine_rank * (1 - aliased)) + sequence
    # Engines never share a GPU (engine g spans its group's GPUs); async_rl separate's never sleeps.
    asleep = {"engine awake": engine} if separate else {"engines asleep": ENGINE_ASLEEP}
    # the optimizer step comes after the last backward
    for phase in ("actor_update", "critic_update", "teacher", "reward_model"):
        if phase in plan.phases:
            plan.phases[phase] |= asleep
    # The hand-over: the engine's weights awake (its KV cache not yet), next to the actor's.
    plan.phases["handover"] |= {"engine awake": engine} if separate else {
        "engine weights": int(engine_rank * (1 - aliased)), "engines asleep": ENGINE_ASLEEP}
    plan.phases["generate"] = with_overhead(resident("generate"), "generate") | {"engine awake": engine}
    if cfg.reward_model.judge is not None:  # rank 0's judge engine (a sync run's): asleep but in its own phase
        fraction = cfg.reward_model.judge.gpu_memory_fraction
        judge = int(fraction * (gpu_bytes - at_start)) + ENGINE_OVERHEAD if cfg.rollout.engine == "sglang" else \
            int(fraction * gpu_bytes)
        for parts in plan.phases.values():
            parts["judge asleep"] = ENGINE_ASLEEP
        plan.phases["judge"] = with_overhead(resident("reward_model")) | asleep | {"judge awake": judge}
    plan = _with_host(plan, resident)
    if cfg.rollout.engine == "vllm" and not separate:
        # vLLM's sleep (level 1) keeps the engine's weights in pinned host memory, a block a tensor, each of which
        # torch rounds up to a power of two; and every hand-over writes the engine rank's tensors to /dev/shm, host
        # memory too, from a host copy of them all (write_engine_file: safetensors writes a file from memory).
        from megarl.reshard.engine_layout import engine_tensors

        pinned = sum(1 << max(math.prod(t.shape) * dtype - 1, 0).bit_length()
                     for t in engine_tensors(spec, cfg.rollout.tensor_parallel, 0))
        plan.host |= {"vLLM engine weights asleep": pinned, "hand-over file (/dev/shm)": engine_rank,
                      "hand-over file's host copy": engine_rank}
    return plan


@dataclass
class Fp8Handover:
    """rollout.weight_dtype = fp8 on the busiest GPU: the engine rank's parameters (FP8 weights and their float32
    scales, the rest in the trainer's dtype) and what the trainer's quantization holds during a hand-over."""

    engine_bytes: int
    buffer_bytes: int


def fp8_handover(cfg: Config, spec: ModelSpec, dims: ParallelDims, dtype_bytes: int) -> Fp8Handover | None:
    """The FP8 hand-over's memory from its plan (megarl.reshard.executor.fp8_buffer_bytes), or None where the
    engine holds the trainer's dtype (or no whole engine fits the trainer's GPUs, a layout start-up refuses). The plan
    covers the fewest data-parallel replicas whose GPUs hold whole engines (trainer TP1 under rollout TP2: two)."""
    r = cfg.rollout
    replicas = r.tensor_parallel // math.gcd(dims.tp * dims.pp, r.tensor_parallel)
    if r.weight_dtype != "fp8" or r.engine != "sglang" or dims.dp % replicas:
        return None
    from megarl.reshard.executor import fp8_buffer_bytes
    from megarl.reshard.planner import make_plan

    plan = make_plan(spec, ParallelDims(tp=dims.tp, pp=dims.pp, dp=replicas), r.tensor_parallel,
                     element_size=dtype_bytes, bucket_bytes=r.reshard_bucket_mb * 2**20,
                     vocab_pad_multiple=cfg.model.vocab_pad_multiple, weight_dtype="fp8", fp8_block=r.fp8_block)

    def engine_bytes(gpu: int) -> int:
        quantized = plan.fp8_tensors(gpu)
        total = 0
        for name, shape in plan.engine_shapes(gpu).items():
            g = quantized.get(name)
            total += math.prod(shape) * dtype_bytes if g is None else \
                math.prod(g.shape) + 4 * math.prod(g.scale_shape)
        return total

    gpus = range(plan.num_gpus)
    return Fp8Handover(engine_bytes=max(engine_bytes(g) for g in gpus),
                       buffer_bytes=max(fp8_buffer_bytes(plan, g, r.landing_buffer_mb * 2**20) for g in gpus))


def _with_host(plan: MemoryPlan, resident: Callable[[str], dict[str, int]]) -> MemoryPlan:
    """Grads are freed, never copied; every other part that leaves the GPU in some phase has a host buffer."""
    held = [resident(phase) for phase in ("actor_update", "critic_update", "values", "reference", "teacher",
                                          "reward_model", "generate")]
    plan.host = {k: v for parts in held for k, v in parts.items()
                 if not k.endswith("grads") and any(k not in other for other in held)}
    return plan


def reward_spec(cfg: Config) -> ModelSpec | None:
    """The reward model's body (reward_model.path), or None without one."""
    if cfg.reward_model.path is None:  # none, or a judge (an engine: plan_memory's judge phase)
        return None
    from megarl.models.reward_model import load_reward_spec

    assert cfg.reward_model.path is not None
    return load_reward_spec(cfg.reward_model.path)


def resolved_fraction(cfg: Config, gpu_bytes: int, trainer_at_start: int, trainer_beside: int) -> float:
    """rollout.gpu_memory_fraction, with ``auto`` sized to what the trainer leaves (SGLang: a share of the free
    memory at its start, ``trainer_at_start`` in use; vLLM: a share of the whole GPU). ``trainer_beside``: the
    most the trainer holds while the engine is awake (what it holds at the engine's start; async_rl separate: its
    busiest phase)."""
    fraction = cfg.rollout.gpu_memory_fraction
    if fraction != "auto":
        return float(fraction)
    free = gpu_bytes * (1 - MARGIN) - trainer_beside - ENGINE_OVERHEAD
    if cfg.rollout.engine == "sglang":
        return max(0.05, min(0.9, free / (gpu_bytes - trainer_at_start)))
    return max(0.05, min(0.9, free / gpu_bytes))


def host_need(plan: MemoryPlan, gpus_per_node: int) -> int:
    """Host bytes one node needs: every local rank's offload buffers and processes."""
    return gpus_per_node * (plan.host_bytes() + HOST_PER_GPU)


def check_host_memory(plan: MemoryPlan, cfg: Config, gpus_per_node: int, host_bytes: int) -> None:
    """Refuse a plan whose offload buffers do not fit the node's memory (``host_bytes``: MemTotal)."""
    need, usable = host_need(plan, gpus_per_node), int(host_bytes * (1 - HOST_MARGIN))
    if need <= usable:
        return
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(plan.host.items(), key=lambda kv: -kv[1]))
    flags = {"actor optimizer": "actor.offload_optimizer", "actor weights": "actor.offload_weights",
             "critic optimizer": "critic.offload_optimizer",
             "critic weights": "critic.offload_weights", "reference weights": "reference.offload_weights",
             "teacher weights": "distill.offload_weights", "reward model weights": "reward_model.offload_weights"}
    keep = [f"{flags[k]}: false" for k in sorted(plan.host, key=lambda k: -plan.host[k]) if k in flags]
    raise UserError(f"this config does not fit its node's host memory: offloading needs {need / GIB:.1f} GiB "
                    f"on a node of {gpus_per_node} GPUs ({plan.host_bytes() / GIB:.1f} GiB of pinned buffers per "
                    f"GPU: {parts}; plus each process's own), more than the {usable / GIB:.1f} GiB usable of "
                    f"{host_bytes / GIB:.1f} GiB. Ways out: keep the largest part on the GPU "
                    f"({keep[0] if keep else '-'}, if the GPU plan still fits); shard the optimizer over more "
                    f"data-parallel ranks "
                    f"(actor/critic.optimizer.use_distributed_optimizer: true, more GPUs); or raise "
                    f"parallel.tensor_parallel / pipeline_parallel.")


def check_memory(plan: MemoryPlan, cfg: Config, num_gpus: int) -> None:
    """Refuse a plan with a phase that does not fit, naming every such phase, its numbers and the ways out, and an
    engine share too small for the engine's own weights."""
    if plan.engine_share and plan.engine_share < plan.engine_floor:
        least = plan.engine_fraction * plan.engine_floor / plan.engine_share
        fix = (f"set rollout.gpu_memory_fraction to {min(least * 1.1, 0.95):.2f} or more"
               if cfg.rollout.gpu_memory_fraction != "auto" else
               "offload more of the trainer while generating (actor.offload_optimizer, actor.offload_weights) or "
               "spread the engine over more GPUs (rollout.tensor_parallel)")
        raise UserError(f"`rollout.gpu_memory_fraction` = {cfg.rollout.gpu_memory_fraction} gives the rollout engine "
                        f"{plan.engine_share / GIB:.1f} GiB on its GPU, less than the {plan.engine_floor / GIB:.1f} "
                        "GiB it needs to start (its weights not mapped from the actor's, and one sequence's KV cache "
                        "of rollout.max_prompt_tokens + max_new_tokens): it would fail at its start, after the "
                        f"models are built. Fix: {fix}.")
    usable = plan.gpu_bytes * (1 - MARGIN)
    over = [phase for phase in plan.phases if plan.total(phase) > usable]
    if not over:
        return
    ways = []
    if "generate" in over:
        ways.append("lower rollout.gpu_memory_fraction (or set it to auto)")
    if "judge" in over:
        ways.append("lower reward_model.judge.gpu_memory_fraction")
    if not (cfg.actor.offload_optimizer and cfg.actor.offload_weights and cfg.critic.offload_weights
            and cfg.critic.offload_optimizer and cfg.reference.offload_weights and cfg.distill.offload_weights
            and cfg.reward_model.offload_weights):
        ways.append("enable offloading (actor.offload_optimizer, actor.offload_weights, critic.offload_weights, "
                    "critic.offload_optimizer, reference.offload_weights, distill.offload_weights, "
                    "reward_model.offload_weights)")
    if any(phase.endswith("update") for phase in over):
        ways.append("lower actor/critic.max_tokens_per_gpu")
        if not cfg.model.recompute_activations:
            ways.append("set model.recompute_activations: true")
    ways.append(f"spread the model over more GPUs (raise parallel.tensor_parallel or pipeline_parallel; now "
                f"{num_gpus} GPUs)")
    needs = ", ".join(f"{plan.total(phase) / GIB:.1f} GiB in its {phase} phase" for phase in over)
    raise UserError(f"this config does not fit its GPUs: it needs {needs} on the busiest GPU, more than the "
                    f"{usable / GIB:.1f} GiB usable of {plan.gpu_bytes / GIB:.1f} GiB. Plan: {plan.table()}. Ways "
                    f"out: {'; '.join(ways)}. (Estimates; the measured peaks are logged as memory/*.)")
