"""Build Llama/Qwen2/Qwen3(-MoE) (and the critic) as megatron-core GPTModel chunks and load HF weights into them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from megarl.distributed.parallel import ParallelGroups
from megarl.models.critic import ValueHead
from megarl.models.hf_io import HFReader
from megarl.models.mapping import VOCAB, ParamRule, Reader, chunk_first_layer, hf_shapes, param_rules, to_mcore_shard
from megarl.models.spec import ModelSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# TE fuses the pre-attention and pre-MLP norms into the following linear layer; canonical names are the local spec's.
_TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# An expert's weights: local-spec SequentialMLP names, or TE's grouped GEMM names; canonical names use the global index.
_EXPERT = (re.compile(r"^mlp\.experts\.local_experts\.(?P<index>\d+)\.(?P<linear>linear_fc[12])\.weight$"),
           re.compile(r"^mlp\.experts\.(?P<linear>linear_fc[12])\.weight(?P<index>\d+)$"))


@dataclass(frozen=True, slots=True)
class BuildOptions:
    dtype: torch.dtype = torch.float32
    vocab_pad_multiple: int = 128
    transformer_engine: bool = False
    sequence_parallel: bool = False
    recompute_activations: bool = False
    critic: bool = False
    """Replace the LM head by a scalar value head (PPO critic)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE: weight of the router's load-balancing loss (0 = none, RL's usual choice)."""
    fused_attention: bool = True
    """Local spec: torch's fused SDPA as core attention; False keeps Megatron's unfused DotProductAttention
    (the baseline benchmarks/train_throughput.py compares against)."""
    packing: Literal["auto", "thd", "segments", "off"] = "auto"
    """How several sequences share a row (megarl.models.forward): "thd", Megatron's packed format (the rows laid
    end to end with PackedSeqParams' cu_seqlens; Transformer Engine's attention and megarl's take it); "segments",
    the rows' segment ids as the attention mask (megarl's attention only); "off", one sequence per row. auto: thd
    with TE, segments with megarl's attention, off with Megatron's unfused attention."""
    logprob_chunk_tokens: int = 0
    """Log-probabilities and entropy from the output layer's input, this many tokens at a time, without the
    micro-batch's logits (megarl.models.logprob_head); 0 = from Megatron's full logits. Not for the critic."""

    def packed_format(self) -> str:
        """``packing`` with auto resolved: "thd", "segments" or "off"."""
        if self.packing != "auto":
            assert self.packing == "off" or self.transformer_engine or self.fused_attention, self
            assert self.packing != "segments" or not self.transformer_engine, "TE's attention takes no segment ids"
            return self.packing
        return "thd" if self.transformer_engine else "segments" if self.fused_attention else "off"


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # TE raises RuntimeError, not ImportError, when CUDA is missing
        return False
    return torch.cuda.is_available()


def transformer_config(spec: ModelSpec, groups: ParallelGroups, opts: BuildOptions) -> Any:
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=groups.dims.tp,
        pipeline_model_parallel_size=groups.dims.pp,
        virtual_pipeline_model_parallel_size=groups.dims.vpp,
        sequence_parallel=opts.sequence_parallel,
        params_dtype=opts.dtype,
        pipeline_dtype=opts.dtype,
        bf16=opts.dtype == torch.bfloat16,
        fp16=opts.dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # Fusions need TE/apex kernels (or torch.compile on CPU, 30 s per shape): only with TE on GPU.
        bias_activation_fusion=on_gpu and opts.transformer_engine,
        masked_softmax_fusion=on_gpu and opts.transformer_engine,
        bias_dropout_fusion=on_gpu and opts.transformer_engine,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # TE's fused RoPE, which also takes packed (THD) rows without the per-sequence loop of Megatron's.
        apply_rope_fusion=on_gpu and opts.transformer_engine,
        # Batched p2p with interleaved PP over gloo gives silently wrong grads (notes/megatron_cpu.md).
        batch_p2p_comm=on_gpu,
        recompute_granularity="full" if opts.recompute_activations else None,
        recompute_method="uniform" if opts.recompute_activations else None,
        recompute_num_layers=1 if opts.recompute_activations else None,
        **(_moe_config(spec, groups, opts) if spec.is_moe else {}),
    )


def _moe_config(spec: ModelSpec, groups: ParallelGroups, opts: BuildOptions) -> dict[str, Any]:
    """Qwen3-MoE's routing as transformers computes it: softmax over the router's logits, the top k experts,
    their probabilities renormalised (norm_topk_prob; Megatron's top-k-then-softmax is the same thing) or not
    (softmax first); no shared expert; tokens dispatched all-to-all over the expert-parallel ranks."""
    from megarl.platform.megatron_fixes import fix_moe_without_te

    fix_moe_without_te()
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.num_experts_per_tok,
        moe_ffn_hidden_size=spec.moe_intermediate_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if opts.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=opts.moe_aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=opts.transformer_engine,
        expert_model_parallel_size=groups.dims.ep,
    )


def llama3_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies with Llama 3.1's long-context scaling (all four of its parameters)."""
    assert spec.rope_scaling is not None
    s = spec.rope_scaling
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def chunk_layer_offset(spec: ModelSpec, groups: ParallelGroups, vp_stage: int) -> int:
    """Global index of the first layer of this rank's virtual-pipeline chunk ``vp_stage``."""
    return chunk_first_layer(spec, groups.dims.pp, groups.dims.vpp, groups.pp_rank, vp_stage)


def build_model(spec: ModelSpec, groups: ParallelGroups, opts: BuildOptions) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline stage), randomly initialised."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    config = transformer_config(spec, groups, opts)
    experts = spec.num_experts or None
    if opts.transformer_engine:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=bool(experts),
                                                                qk_layernorm=spec.qk_norm)
    else:
        from megarl.models.attention import FusedCoreAttention

        layer_spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm",
                                              qk_layernorm=spec.qk_norm)
        if opts.fused_attention:
            layer_spec.submodules.self_attention.submodules.core_attention = FusedCoreAttention
    num_chunks = groups.dims.vpp or 1
    chunks: list[torch.nn.Module] = []
    for vp in range(num_chunks):
        first = groups.is_first_stage and vp == 0
        last = groups.is_last_stage and vp == num_chunks - 1
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.padded_vocab_size(groups.dims.tp, opts.vocab_pad_multiple),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=spec.tie_word_embeddings and not opts.critic,
            position_embedding_type="rope",
            # a float: megatron-core types it int but only raises it to a power, and int() would drop a
            # fractional rope_theta's part (transformers uses it whole)
            rotary_base=spec.rope_theta,
            vp_stage=vp if groups.dims.vpp else None,
        )
        if spec.rope_scaling is not None:
            model.rotary_pos_emb.inv_freq = llama3_inv_freq(spec).to(model.rotary_pos_emb.inv_freq.device)
        if opts.critic and last:
            model.output_layer = ValueHead(config, groups.tp_group)
        # torch's RMSNorm (local spec) makes fp32 weights whatever params_dtype says. Megatron's own 16-bit
        # training casts the whole model (Float16Module), and engines hold every weight in the training
        # dtype, which lets the resharder move bytes without converting them.
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != opts.dtype:
                param.data = param.data.to(opts.dtype)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def layer_implementation(chunks: list[torch.nn.Module]) -> str:
    """The classes that run a transformer layer here (QKV projection, core attention, first MLP linear or MoE
    experts): whether a run used Transformer Engine or the local spec, read from the model itself."""
    decoder: Any = unwrap(chunks[0]).decoder
    layer = decoder.layers[0]
    attention, mlp = layer.self_attention, layer.mlp
    ffn = getattr(mlp, "experts", None) or mlp.linear_fc1
    return ", ".join(type(m).__name__ for m in (attention.linear_qkv, attention.core_attention, ffn))


def canonical_params(chunks: list[torch.nn.Module], spec: ModelSpec,
                     groups: ParallelGroups) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by canonical name (local-spec names, global layer indices); LoRA adapters not
    included."""
    out = {}
    first_expert = groups.ep_rank * (spec.num_experts // groups.dims.ep)
    for vp, chunk in enumerate(chunks):
        offset = chunk_layer_offset(spec, groups, vp)
        for name, param in unwrap(chunk).named_parameters():
            if ".lora." in name:
                continue  # LoRA adapters (megarl.lora) are not the model's weights
            match = _LAYER.match(name)
            if match:
                rest = _TE_NAMES.get(match.group(2), match.group(2))
                for pattern in _EXPERT:
                    if expert := pattern.match(rest):
                        rest = f"mlp.experts.{first_expert + int(expert['index'])}.{expert['linear']}.weight"
                name = f"decoder.layers.{int(match.group(1)) + offset}.{rest}"
            out[name] = param
    return out


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module  # type: ignore[assignment]
    return module


def load_hf_weights(chunks: list[torch.nn.Module], spec: ModelSpec, hf_dir: str, groups: ParallelGroups,
                    opts: BuildOptions) -> None:
    """Fill this rank's chunks from a HF checkpoint, reading only the slices this rank owns."""
    load_weights(chunks, spec, HFReader(hf_dir, spec, hf_shapes(spec)).read, groups, opts)


def load_weights(chunks: list[torch.nn.Module], spec: ModelSpec, read: Reader, groups: ParallelGroups,
                 opts: BuildOptions) -> None:
    """Fill this rank's chunks from HF-named tensors served by ``read`` (see mapping.Reader)."""
    rules = {r.mcore: r for r in param_rules(spec, include_output=not opts.critic)}
    if spec.tie_word_embeddings and not opts.critic:
        # With PP > 1 the last stage keeps its own copy of the tied embedding as its output layer.
        rules["output_layer.weight"] = ParamRule("output_layer.weight", ("model.embed_tokens.weight",), VOCAB)
    padded_vocab = spec.padded_vocab_size(groups.dims.tp, opts.vocab_pad_multiple)
    with torch.no_grad():
        for name, param in canonical_params(chunks, spec, groups).items():
            if opts.critic and name.startswith("output_layer."):
                continue  # the value head starts fresh
            assert name in rules, f"no HF mapping for Megatron parameter {name}"
            shard = to_mcore_shard(rules[name], spec, read, groups.tp_rank, groups.dims.tp, padded_vocab)
            assert shard.shape == param.shape, (name, shard.shape, param.shape)
            param.copy_(shard)
