"""How each HuggingFace tensor becomes Megatron TP shards and back: pure tensor functions.

Megatron's layouts that differ from HF (see DESIGN.md):
- fused QKV is interleaved by query group: [group][q_per_group q heads, k head, v head][head_dim],
  and TP splits whole groups;
- fc1 is [gate shard; up shard] per TP rank;
- embedding and output rows are padded to the padded vocab (zeros) and split over TP;
- row-parallel weights (o_proj, down_proj) split along dim 1; norms are replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.models.spec import ModelSpec

# read(hf_name, dim, start, stop) -> the HF tensor restricted to [start, stop) along dim (dim None: all).
Reader = Callable[[str, int | None, int, int], torch.Tensor]

VOCAB, QKV, FC1, ROW, REPLICATED = "vocab", "qkv", "fc1", "row", "replicated"


@dataclass(frozen=True, slots=True)
class ParamRule:
    """One Megatron parameter: its canonical name, the HF tensors it is made of, and how it is split."""

    mcore: str
    """Canonical Megatron name (local layer spec, global layer index)."""
    hf: tuple[str, ...]
    kind: str
    layer: int | None = None


def param_rules(spec: ModelSpec, *, include_output: bool = True) -> list[ParamRule]:
    """Every Megatron parameter of the model, in forward order."""
    rules = [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB)]
    for i in range(spec.num_layers):
        d, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = tuple(f"{h}self_attn.{p}_proj.weight" for p in "qkv")
        rules += [
            ParamRule(d + "input_layernorm.weight", (h + "input_layernorm.weight",), REPLICATED, i),
            ParamRule(d + "self_attention.linear_qkv.weight", attn, QKV, i),
        ]
        if spec.qkv_bias:
            bias = tuple(f"{h}self_attn.{p}_proj.bias" for p in "qkv")
            rules.append(ParamRule(d + "self_attention.linear_qkv.bias", bias, QKV, i))
        rules += [
            ParamRule(d + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), ROW, i),
            ParamRule(d + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), REPLICATED, i),
            ParamRule(d + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), FC1, i),
            ParamRule(d + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), ROW, i),
        ]
    rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
    if include_output and not spec.tie_word_embeddings:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), VOCAB))
    return rules


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The shape every HF tensor must have."""
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        }
        if spec.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def to_mcore_shard(rule: ParamRule, spec: ModelSpec, read: Reader, tp_rank: int, tp: int,
                   padded_vocab: int) -> torch.Tensor:
    """Megatron's TP shard ``tp_rank`` of ``rule``, reading only the HF slices that shard needs."""
    if rule.kind == REPLICATED:
        return read(rule.hf[0], None, 0, 0)
    if rule.kind == ROW:
        step = _row_cols(rule, spec) // tp
        return read(rule.hf[0], 1, tp_rank * step, (tp_rank + 1) * step)
    if rule.kind == FC1:
        step = spec.intermediate_size // tp
        return torch.cat([read(name, 0, tp_rank * step, (tp_rank + 1) * step) for name in rule.hf])
    if rule.kind == VOCAB:
        step = padded_vocab // tp
        start, stop = tp_rank * step, (tp_rank + 1) * step
        rows = read(rule.hf[0], 0, start, min(stop, spec.vocab_size)) if start < spec.vocab_size else None
        out = torch.zeros((step, spec.hidden_size), dtype=rows.dtype if rows is not None else torch.float32)
        if rows is not None:
            out[: rows.shape[0]] = rows
        return out
    assert rule.kind == QKV, rule
    groups, d, qpg = spec.num_kv_heads // tp, spec.head_dim, spec.q_per_group
    g0 = tp_rank * groups
    q = read(rule.hf[0], 0, g0 * qpg * d, (g0 + groups) * qpg * d)
    k = read(rule.hf[1], 0, g0 * d, (g0 + groups) * d)
    v = read(rule.hf[2], 0, g0 * d, (g0 + groups) * d)
    tail = q.shape[1:]
    parts = [q.reshape(groups, qpg * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)]
    return torch.cat(parts, dim=1).reshape(groups * (qpg + 2) * d, *tail)


def _row_cols(rule: ParamRule, spec: ModelSpec) -> int:
    return spec.num_attention_heads * spec.head_dim if "linear_proj" in rule.mcore else spec.intermediate_size


def to_hf(rule: ParamRule, spec: ModelSpec, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors of ``rule`` from its Megatron TP shards (ordered by TP rank); inverse of to_mcore_shard."""
    if rule.kind == REPLICATED:
        return {rule.hf[0]: shards[0]}
    if rule.kind == ROW:
        return {rule.hf[0]: torch.cat(shards, dim=1)}
    if rule.kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return {rule.hf[0]: torch.cat([g for g, _ in halves]), rule.hf[1]: torch.cat([u for _, u in halves])}
    if rule.kind == VOCAB:
        return {rule.hf[0]: torch.cat(shards)[: spec.vocab_size]}
    assert rule.kind == QKV, rule
    d, qpg = spec.head_dim, spec.q_per_group
    full = torch.cat(shards)
    tail = full.shape[1:]
    grouped = full.reshape(spec.num_kv_heads, (qpg + 2) * d, *tail)
    q, k, v = grouped.split([qpg * d, d, d], dim=1)
    return {rule.hf[0]: q.reshape(-1, *tail), rule.hf[1]: k.reshape(-1, *tail), rule.hf[2]: v.reshape(-1, *tail)}
