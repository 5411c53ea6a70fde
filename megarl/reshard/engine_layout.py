"""The rollout engines' per-rank parameter layout (SGLang and vLLM share it for Llama/Qwen2/Qwen3).

Engine rank r of an engine with tensor parallelism R holds (DESIGN.md, "The resharding problem"):
- embed_tokens / lm_head: rows r*Vp/R .. (r+1)*Vp/R of the vocab padded to a multiple of 64 (pad rows zero);
- qkv_proj: [q heads of rank r; its k head(s); its v head(s)], kv heads replicated when R > num_kv_heads;
- o_proj: the columns of rank r's q heads; gate_up_proj: [gate rows of r; up rows of r];
- down_proj: rank r's columns of the intermediate dim; norms (Qwen3's q_norm/k_norm too) replicated.
- MoE layers (Qwen3-MoE; the engines' FusedMoE, experts split by TP): mlp.gate (the router) replicated;
  experts.w13_weight [E, 2 I/R, hidden]: per expert [gate rows of r; up rows of r]; experts.w2_weight
  [E, hidden, I/R]: per expert rank r's columns of down_proj.
Tied embeddings: the engine's lm_head shares embed_tokens, so only embed_tokens is written.

Tensors of three dims (the experts) are addressed as the matrix [-1, last dim] (``matrix_shape``): a piece along
dim 0 covers rows of it, and a piece along dim 1 covers columns of a block of rows, its ``offset`` counting
elements from the matrix's start (block row * columns + first column).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.errors import UserError
from megarl.models.mapping import Piece
from megarl.models.spec import ModelSpec

ENGINE_VOCAB_PAD = 64


@dataclass(frozen=True, slots=True)
class EngineTensor:
    """One engine parameter on one engine rank: its name, shape, and the HF pieces that fill it."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    layer: int | None = None


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, columns) a tensor is addressed as: [n] as [n, 1], [a, b] as itself, [a, b, c] as [a * b, c]."""
    return (shape[0], 1) if len(shape) == 1 else (math.prod(shape[:-1]), shape[-1])


def engine_vocab_padded(spec: ModelSpec) -> int:
    return math.ceil(spec.vocab_size / ENGINE_VOCAB_PAD) * ENGINE_VOCAB_PAD


def check_rollout_tp(spec: ModelSpec, rollout_tp: int, field: str = "rollout.tensor_parallel") -> None:
    """Reject engine TP sizes the engine layout cannot express, before anything is allocated."""
    problems = []
    if spec.num_attention_heads % rollout_tp:
        problems.append(f"num_attention_heads={spec.num_attention_heads} is not divisible by it")
    if rollout_tp % spec.num_kv_heads and spec.num_kv_heads % rollout_tp:
        problems.append(f"it neither divides nor is a multiple of num_key_value_heads={spec.num_kv_heads}")
    if spec.ffn_size(spec.is_moe) % rollout_tp:
        field_name = "moe_intermediate_size" if spec.is_moe else "intermediate_size"
        problems.append(f"{field_name}={spec.ffn_size(spec.is_moe)} is not divisible by it")
    if engine_vocab_padded(spec) % rollout_tp:
        problems.append(f"the engine's padded vocab {engine_vocab_padded(spec)} is not divisible by it")
    if problems:
        valid = [r for r in range(1, spec.num_attention_heads + 1) if _fits(spec, r)]
        raise UserError(f"{field} = {rollout_tp} cannot hold this model: {'; '.join(problems)}. "
                        f"Use one of {valid}.")


def _fits(spec: ModelSpec, r: int) -> bool:
    return (spec.num_attention_heads % r == 0 and (r % spec.num_kv_heads == 0 or spec.num_kv_heads % r == 0)
            and spec.ffn_size(spec.is_moe) % r == 0 and engine_vocab_padded(spec) % r == 0)


def engine_tensors(spec: ModelSpec, rollout_tp: int, rank: int) -> list[EngineTensor]:
    """Every parameter of engine rank ``rank`` (of ``rollout_tp``), in forward order."""
    check_rollout_tp(spec, rollout_tp)
    R, h, d = rollout_tp, spec.hidden_size, spec.head_dim
    rows = engine_vocab_padded(spec) // R
    v0, v1 = rank * rows, min((rank + 1) * rows, spec.vocab_size)
    vocab_pieces = lambda name: (Piece(name, 0, v0, v1, 0),) if v0 < v1 else ()  # noqa: E731

    nq = spec.num_attention_heads // R
    if R <= spec.num_kv_heads:
        nkv, kv0 = spec.num_kv_heads // R, rank * spec.num_kv_heads // R
    else:
        nkv, kv0 = 1, rank // (R // spec.num_kv_heads)
    q0, inter = rank * nq, spec.intermediate_size // R
    out = [EngineTensor("model.embed_tokens.weight", (rows, h), vocab_pieces("model.embed_tokens.weight"))]
    for i in range(spec.num_layers):
        e, p = f"model.layers.{i}.", f"model.layers.{i}."

        def qkv(kind: str, p: str = p) -> tuple[Piece, ...]:
            q, k, v = (f"{p}self_attn.{x}_proj.{kind}" for x in "qkv")
            return (Piece(q, 0, q0 * d, (q0 + nq) * d, 0),
                    Piece(k, 0, kv0 * d, (kv0 + nkv) * d, nq * d),
                    Piece(v, 0, kv0 * d, (kv0 + nkv) * d, (nq + nkv) * d))

        qkv_rows = (nq + 2 * nkv) * d
        out += [
            EngineTensor(e + "input_layernorm.weight", (h,), (Piece(p + "input_layernorm.weight", 0, 0, h, 0),), i),
            EngineTensor(e + "self_attn.qkv_proj.weight", (qkv_rows, h), qkv("weight"), i),
        ]
        if spec.qkv_bias:
            out.append(EngineTensor(e + "self_attn.qkv_proj.bias", (qkv_rows,), qkv("bias"), i))
        if spec.qk_norm:
            out += [EngineTensor(e + f"self_attn.{x}_norm.weight", (d,), (Piece(p + f"self_attn.{x}_norm.weight",
                                                                                0, 0, d, 0),), i) for x in "qk"]
        out += [
            EngineTensor(e + "self_attn.o_proj.weight", (h, nq * d),
                         (Piece(p + "self_attn.o_proj.weight", 1, q0 * d, (q0 + nq) * d, 0),), i),
            EngineTensor(e + "post_attention_layernorm.weight", (h,),
                         (Piece(p + "post_attention_layernorm.weight", 0, 0, h, 0),), i),
        ]
        if spec.is_moe:
            out += _moe_tensors(spec, R, rank, i)
            continue
        out += [
            EngineTensor(e + "mlp.gate_up_proj.weight", (2 * inter, h),
                         (Piece(p + "mlp.gate_proj.weight", 0, rank * inter, (rank + 1) * inter, 0),
                          Piece(p + "mlp.up_proj.weight", 0, rank * inter, (rank + 1) * inter, inter)), i),
            EngineTensor(e + "mlp.down_proj.weight", (h, inter),
                         (Piece(p + "mlp.down_proj.weight", 1, rank * inter, (rank + 1) * inter, 0),), i),
        ]
    out.append(EngineTensor("model.norm.weight", (h,), (Piece("model.norm.weight", 0, 0, h, 0),)))
    if not spec.tie_word_embeddings:
        out.append(EngineTensor("lm_head.weight", (rows, h), vocab_pieces("lm_head.weight")))
    return out


def _moe_tensors(spec: ModelSpec, R: int, rank: int, layer: int) -> list[EngineTensor]:
    """Layer ``layer``'s router and experts on engine rank ``rank`` (FusedMoE's layout, experts split by TP)."""
    h, n, inter = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size // R
    p = f"model.layers.{layer}.mlp."
    lo, hi = rank * inter, (rank + 1) * inter
    w13 = tuple(piece for x in range(n) for piece in (
        Piece(f"{p}experts.{x}.gate_proj.weight", 0, lo, hi, 2 * x * inter),
        Piece(f"{p}experts.{x}.up_proj.weight", 0, lo, hi, (2 * x + 1) * inter)))
    w2 = tuple(Piece(f"{p}experts.{x}.down_proj.weight", 1, lo, hi, x * h * inter) for x in range(n))
    return [EngineTensor(p + "gate.weight", (n, h), (Piece(p + "gate.weight", 0, 0, n, 0),), layer),
            EngineTensor(p + "experts.w13_weight", (n, 2 * inter, h), w13, layer),
            EngineTensor(p + "experts.w2_weight", (n, h, inter), w2, layer)]
