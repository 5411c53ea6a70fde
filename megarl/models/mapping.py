"""How each HuggingFace tensor becomes Megatron TP shards and back, described as pieces.

A shard is a concatenation, along one dim, of ranges of HF tensors (``Piece``s); the rest of
the shard (vocab padding) is zero. Megatron's layouts that differ from HF (see DESIGN.md):
- fused QKV is interleaved by query group: [group][q_per_group q heads, k head, v head][head_dim],
  and TP splits whole groups;
- fc1 is [gate shard; up shard] per TP rank;
- embedding and output rows are padded to the padded vocab (zeros) and split over TP;
- row-parallel weights (o_proj, down_proj) split along dim 1; norms (QK-norm's too) are replicated.
- MoE layers (Qwen3-MoE): the router [num_experts, hidden] is replicated; each expert is an MLP of its own
  (fc1 = [gate; up] per TP rank, fc2 row-parallel, as the dense MLP), named by its global index
  (``decoder.layers.L.mlp.experts.E.linear_fc1.weight``) whichever expert-parallel rank holds it.
The same pieces drive checkpoint conversion, weight loading and the resharding planner.
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
    """Canonical Megatron name (local layer spec, global layer and expert indices)."""
    hf: tuple[str, ...]
    kind: str
    layer: int | None = None
    expert: int | None = None
    """The expert an MoE weight belongs to (global index); None for every other parameter."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, stop)`` along ``dim`` of HF tensor ``hf``, placed at ``offset`` along ``dim`` of a shard."""

    hf: str
    dim: int
    start: int
    stop: int
    offset: int

    @property
    def length(self) -> int:
        return self.stop - self.start


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
        if spec.qk_norm:
            rules += [ParamRule(d + f"self_attention.{p}_layernorm.weight", (h + f"self_attn.{p}_norm.weight",),
                                REPLICATED, i) for p in "qk"]
        rules += [
            ParamRule(d + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), ROW, i),
            ParamRule(d + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), REPLICATED, i),
        ]
        if spec.is_moe:
            rules.append(ParamRule(d + "mlp.router.weight", (h + "mlp.gate.weight",), REPLICATED, i))
            for e in range(spec.num_experts):
                m, x = f"{d}mlp.experts.{e}.", f"{h}mlp.experts.{e}."
                rules += [ParamRule(m + "linear_fc1.weight", (x + "gate_proj.weight", x + "up_proj.weight"), FC1, i, e),
                          ParamRule(m + "linear_fc2.weight", (x + "down_proj.weight",), ROW, i, e)]
        else:
            rules += [
                ParamRule(d + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), FC1, i),
                ParamRule(d + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), ROW, i),
            ]
    rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
    if include_output and not spec.tie_word_embeddings:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), VOCAB))
    return rules


def chunk_first_layer(spec: ModelSpec, pp: int, vpp: int | None, pp_rank: int, vp_stage: int) -> int:
    """Global index of the first layer of virtual-pipeline chunk ``vp_stage`` on pipeline rank ``pp_rank``.

    As megatron-core places them (get_transformer_layer_offset): the layers split evenly into pp * vpp runs,
    dealt round robin over the pipeline ranks, so with 8 layers, PP 2 and VPP 2 rank 0 holds layers 0-1 and 4-5."""
    per_chunk = spec.num_layers // (pp * (vpp or 1))
    return (vp_stage * pp + pp_rank) * per_chunk


def pipeline_stage(mcore_name: str, spec: ModelSpec, pp: int, vpp: int | None = None) -> int:
    """The pipeline rank holding a Megatron parameter: a layer's chunk (``chunk_first_layer``), the embedding
    on the first rank, the final norm and head on the last (its first and last chunks)."""
    if mcore_name.startswith("decoder.layers."):
        run = int(mcore_name.split(".")[2]) // (spec.num_layers // (pp * (vpp or 1)))
        return run % pp
    return 0 if mcore_name.startswith("embedding.") else pp - 1


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The shape every HF tensor must have."""
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        if spec.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
        }
        if spec.is_moe:
            m = spec.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (spec.num_experts, h)
            for e in range(spec.num_experts):
                x = f"{p}mlp.experts.{e}."
                shapes |= {x + "gate_proj.weight": (m, h), x + "up_proj.weight": (m, h), x + "down_proj.weight": (h, m)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)}
        if spec.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def replicated_shape(rule: ParamRule, spec: ModelSpec) -> tuple[int, ...]:
    """Shape of a replicated weight: [num_experts, hidden] for an MoE router, [head_dim] for QK-norm, [hidden]
    for the other norms."""
    if rule.mcore.endswith("mlp.router.weight"):
        return (spec.num_experts, spec.hidden_size)
    qk_norm = rule.mcore.endswith(("q_layernorm.weight", "k_layernorm.weight"))
    return (spec.head_dim,) if qk_norm else (spec.hidden_size,)


def _row_cols(rule: ParamRule, spec: ModelSpec) -> int:
    """Input width of a row-parallel weight: attention's output projection, or an MLP's (an expert's) fc2."""
    if "linear_proj" in rule.mcore:
        return spec.num_attention_heads * spec.head_dim
    return spec.ffn_size(rule.expert is not None)


def mcore_pieces(rule: ParamRule, spec: ModelSpec, tp_rank: int, tp: int, padded_vocab: int) -> list[Piece]:
    """The pieces of Megatron's TP shard ``tp_rank`` of ``rule``."""
    if rule.kind == REPLICATED:
        return [Piece(rule.hf[0], 0, 0, replicated_shape(rule, spec)[0], 0)]
    if rule.kind == ROW:
        step = _row_cols(rule, spec) // tp
        return [Piece(rule.hf[0], 1, tp_rank * step, (tp_rank + 1) * step, 0)]
    if rule.kind == FC1:
        step = spec.ffn_size(rule.expert is not None) // tp
        return [Piece(name, 0, tp_rank * step, (tp_rank + 1) * step, i * step) for i, name in enumerate(rule.hf)]
    if rule.kind == VOCAB:
        step = padded_vocab // tp
        start = tp_rank * step
        stop = min((tp_rank + 1) * step, spec.vocab_size)
        return [Piece(rule.hf[0], 0, start, stop, 0)] if start < stop else []
    assert rule.kind == QKV, rule
    d, qpg = spec.head_dim, spec.q_per_group
    groups = spec.num_kv_heads // tp
    pieces = []
    for j in range(groups):
        g = tp_rank * groups + j
        base = j * (qpg + 2) * d
        pieces += [Piece(rule.hf[0], 0, g * qpg * d, (g + 1) * qpg * d, base),
                   Piece(rule.hf[1], 0, g * d, (g + 1) * d, base + qpg * d),
                   Piece(rule.hf[2], 0, g * d, (g + 1) * d, base + (qpg + 1) * d)]
    return pieces


def mcore_shape(rule: ParamRule, spec: ModelSpec, tp: int, padded_vocab: int) -> tuple[int, ...]:
    """Shape of one Megatron TP shard of ``rule``."""
    h, d = spec.hidden_size, spec.head_dim
    if rule.kind == REPLICATED:
        return replicated_shape(rule, spec)
    if rule.kind == ROW:
        return (h, _row_cols(rule, spec) // tp)
    if rule.kind == FC1:
        return (2 * spec.ffn_size(rule.expert is not None) // tp, h)
    if rule.kind == VOCAB:
        return (padded_vocab // tp, h)
    rows = (spec.num_attention_heads + 2 * spec.num_kv_heads) * d // tp
    return (rows,) if rule.mcore.endswith(".bias") else (rows, h)


def assemble(pieces: list[Piece], shape: tuple[int, ...], read: Reader) -> torch.Tensor:
    """A shard of ``shape`` built from ``pieces`` (each read from HF), zero where no piece lands."""
    parts = [(p, read(p.hf, p.dim, p.start, p.stop)) for p in pieces]
    if len(parts) == 1 and tuple(parts[0][1].shape) == shape:
        return parts[0][1]
    dtype = parts[0][1].dtype if parts else torch.float32
    out = torch.zeros(shape, dtype=dtype)
    for piece, tensor in parts:
        out.narrow(piece.dim, piece.offset, piece.length).copy_(tensor)
    return out


def to_mcore_shard(rule: ParamRule, spec: ModelSpec, read: Reader, tp_rank: int, tp: int,
                   padded_vocab: int) -> torch.Tensor:
    """Megatron's TP shard ``tp_rank`` of ``rule``, reading only the HF slices that shard needs."""
    return assemble(mcore_pieces(rule, spec, tp_rank, tp, padded_vocab),
                    mcore_shape(rule, spec, tp, padded_vocab), read)


def to_hf(rule: ParamRule, spec: ModelSpec, shards: list[torch.Tensor],
          shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """The HF tensors of ``rule`` from its Megatron TP shards (ordered by TP rank); inverse of to_mcore_shard.
    ``shapes``: hf_shapes(spec), passed by callers that convert every rule (an MoE model has tens of thousands)."""
    tp = len(shards)
    padded_vocab = shards[0].shape[0] * tp if rule.kind == VOCAB else 0
    shapes = shapes if shapes is not None else hf_shapes(spec)
    out = {name: torch.empty(shapes[name], dtype=shards[0].dtype, device=shards[0].device) for name in rule.hf}
    spans: dict[str, set[tuple[int, int, int]]] = {name: set() for name in rule.hf}
    for t, shard in enumerate(shards):
        for p in mcore_pieces(rule, spec, t, tp, padded_vocab):
            out[p.hf].narrow(p.dim, p.start, p.length).copy_(shard.narrow(p.dim, p.offset, p.length))
            spans[p.hf].add((p.dim, p.start, p.stop))
    for name in rule.hf:
        _check_tiled(rule, name, shapes[name], spans[name], tp)
    return out


def _check_tiled(rule: ParamRule, hf: str, shape: tuple[int, ...], spans: set[tuple[int, int, int]], tp: int) -> None:
    """Refuse a HF tensor whose pieces (dim, start, stop) do not tile it along one dim: ``to_hf`` starts from
    uninitialised memory, and a size TP does not divide (its shards rounded down) would leave some of it there.
    Equal spans are one (a replicated tensor comes whole from every shard)."""
    runs: list[list[int]] = []  # [dim, start, stop], touching spans joined
    overlap = False
    for dim, start, stop in sorted(spans):
        if runs and runs[-1][0] == dim and start <= runs[-1][2]:
            overlap |= start < runs[-1][2]
            runs[-1][2] = max(runs[-1][2], stop)
        else:
            runs.append([dim, start, stop])
    if overlap or len(runs) != 1 or runs[0][1] != 0 or runs[0][2] != shape[runs[0][0]]:
        held = ", ".join(f"[{a}, {b}) along dim {d}" for d, a, b in runs) or "nothing"
        raise ValueError(f"{rule.mcore}: its {tp} tensor-parallel shards do not cover HF tensor {hf} of shape "
                         f"{tuple(shape)} exactly once (they hold {held}{', overlapping' if overlap else ''}); a "
                         "size of the model that TP does not divide would leave part of it unwritten.")
