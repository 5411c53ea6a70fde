"""Block-wise FP8 weights in an engine rank's TP layout, quantized by megarl._C from the full bf16 (or fp32) weight.

The format (megarl/reshard/fp8_reference.py): float8_e4m3fn values and one float32 scale per b x b block
(``weight_scale_inv``, the dequantization multiplier), as SGLang's and vLLM's FP8 loaders hold a linear layer of a
``weight_block_size: [b, b]`` checkpoint (b = rollout.fp8_block: 128, or 64 for small models). An engine rank's
shard is a window of the full weight: rows for column-parallel layers (qkv_proj, gate_up_proj: dim 0), columns for
row-parallel ones (o_proj, down_proj: dim 1).
Each block's scale comes from the whole block of the full weight, so a block that a shard boundary cuts has on
every rank the scale a single-rank quantization gives it, and a rank's scales are the rows or columns of the full
weight's scales that its window touches. The engines themselves refuse shards that cut blocks (every per-rank
output part and input slice must be a multiple of b: ``layout_problems`` names them); for such shards both
conventions agree.

Merged layers (qkv_proj = [q; k; v], gate_up_proj = [gate; up]) hold each part quantized on its own block grid, as
a checkpoint stores q_proj, k_proj and v_proj: the engine's loader places each part's scales at its block offset in
the merged ``weight_scale_inv``. ``merged_rows`` writes them so; ``qkv_shard`` picks each part's rows as
engine_layout.py does, key and value heads replicated when the engine's TP exceeds their number.

In the hand-over (``rollout.weight_dtype: fp8``): ``engine_geometry`` gives the planner each quantized engine
tensor's block geometry (``Fp8Tensor``: the window of each full HF weight the engine rank holds, where its rows and
its scales sit in the engine's ``weight`` and ``weight_scale_inv``), and the executor (megarl.reshard.executor)
quantizes with it from the gathered bf16 window, or from the trainer's own tensor where that is the window, straight
into the engine's FP8 parameters. Only the linear layers' weights are quantized (``QUANTIZED``); embeddings, norms,
biases and the output head stay in the trainer's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megarl.errors import UserError
from megarl.models.spec import ModelSpec
from megarl.reshard.fp8_reference import BLOCK
from megarl.reshard.kernels import extension

if TYPE_CHECKING:
    from megarl.reshard.engine_layout import EngineTensor

Block = tuple[int, int]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def scale_span(begin: int, size: int, block: int) -> tuple[int, int]:
    """The blocks [first, first + count) of a grid of ``block`` that the elements [begin, begin + size) touch."""
    if size == 0:
        return begin // block, 0
    first = begin // block
    return first, _ceil(begin + size, block) - first


def quantize(source: torch.Tensor, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
             out: torch.Tensor | None = None, scales: torch.Tensor | None = None, block: Block = (BLOCK, BLOCK),
             name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The window ``rows`` x ``cols`` (half-open ranges; default all) of 2-D ``source`` block-quantized.

    Returns (float8_e4m3fn values of the window, float32 scales of the blocks it touches), written into ``out``
    and ``scales`` where given (views of an engine's parameters: rows contiguous), else into new tensors on the
    source's device. CUDA: asynchronous on the current stream.
    """
    if source.dim() != 2:
        raise ValueError(f"fp8 quantize{f' `{name}`' if name else ''}: the weight must be 2-D [out, in], "
                         f"not of shape {tuple(source.shape)}")
    r0, r1 = rows if rows is not None else (0, source.shape[0])
    c0, c1 = cols if cols is not None else (0, source.shape[1])
    if out is not None and tuple(out.shape) != (r1 - r0, c1 - c0):
        raise ValueError(f"fp8 quantize{f' `{name}`' if name else ''}: out has shape {tuple(out.shape)}, the window "
                         f"rows [{r0}, {r1}) x columns [{c0}, {c1}) has {(r1 - r0, c1 - c0)}")
    if out is None:
        out = torch.empty(max(r1 - r0, 0), max(c1 - c0, 0), dtype=torch.float8_e4m3fn, device=source.device)
    if scales is None:
        scales = torch.empty(scale_span(r0, out.shape[0], block[0])[1], scale_span(c0, out.shape[1], block[1])[1],
                             dtype=torch.float32, device=source.device)
    extension().fp8_block_quantize(source, out, scales, r0, c0, block[0], block[1], name)
    return out, scales


def tp_range(size: int, rank: int, world: int, what: str = "the split dim") -> tuple[int, int]:
    """Rank ``rank``'s half-open slice of ``size`` elements split evenly over ``world`` ranks."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"fp8: rank {rank} is not one of a TP world of {world}")
    if size % world:
        raise ValueError(f"fp8: {what} ({size}) is not divisible by the engine's tensor parallelism {world}")
    step = size // world
    return rank * step, (rank + 1) * step


def shard(weight: torch.Tensor, rank: int, world: int, dim: int, *, block: Block = (BLOCK, BLOCK),
          name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Engine rank ``rank`` of ``world``'s FP8 shard of a full weight split along ``dim`` (0: column-parallel,
    1: row-parallel): (values, scales of the blocks it touches)."""
    if dim not in (0, 1):
        raise ValueError(f"fp8: the split dim must be 0 (column-parallel) or 1 (row-parallel), not {dim}")
    window = tp_range(weight.shape[dim], rank, world, f"dim {dim} of {name or 'the weight'}")
    return quantize(weight, rows=window if dim == 0 else None, cols=window if dim == 1 else None, block=block,
                    name=name)


def merged_rows(parts: Sequence[tuple[torch.Tensor, int, int]], *, block: Block = (BLOCK, BLOCK),
                out: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """A merged column-parallel shard: rows [begin, end) of each full part weight, stacked, each part quantized on
    its own block grid and its scales stacked likewise (``weight_scale_inv`` of qkv_proj or gate_up_proj)."""
    if not parts:
        raise ValueError("fp8 merged_rows: no parts")
    source0 = parts[0][0]
    cols = source0.shape[1]
    if any(p.dim() != 2 or p.shape[1] != cols for p, _, _ in parts):
        raise ValueError(f"fp8 merged_rows{f' `{name}`' if name else ''}: every part must be 2-D with {cols} columns, "
                         f"not shapes {[tuple(p.shape) for p, _, _ in parts]}")
    rows = sum(end - begin for _, begin, end in parts)
    scale_rows = sum(scale_span(begin, end - begin, block[0])[1] for _, begin, end in parts)
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=source0.device)
    if scales is None:
        scales = torch.empty(scale_rows, _ceil(cols, block[1]), dtype=torch.float32, device=source0.device)
    if tuple(out.shape) != (rows, cols) or tuple(scales.shape) != (scale_rows, _ceil(cols, block[1])):
        raise ValueError(f"fp8 merged_rows{f' `{name}`' if name else ''}: out must be [{rows}, {cols}] and scales "
                         f"[{scale_rows}, {_ceil(cols, block[1])}], not {tuple(out.shape)} and {tuple(scales.shape)}")
    row = scale_row = 0
    for i, (part, begin, end) in enumerate(parts):
        n, k = end - begin, scale_span(begin, end - begin, block[0])[1]
        quantize(part, rows=(begin, end), out=out.narrow(0, row, n), scales=scales.narrow(0, scale_row, k),
                 block=block, name=f"{name}[part {i}]" if name else f"part {i}")
        row, scale_row = row + n, scale_row + k
    return out, scales


def qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, rank: int,
             world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rows of the full q_proj and of the full k_proj (and v_proj) that engine rank ``rank`` of ``world`` holds
    (engine_layout.py): its q heads, and its kv heads, one replicated head each when world > num_kv_heads."""
    if num_heads % world or (world % num_kv_heads and num_kv_heads % world):
        raise ValueError(f"fp8 qkv: {num_heads} heads and {num_kv_heads} kv heads cannot be split over an engine "
                         f"TP of {world}")
    nq = num_heads // world
    if world <= num_kv_heads:
        nkv = num_kv_heads // world
        kv0 = rank * nkv
    else:
        nkv, kv0 = 1, rank // (world // num_kv_heads)
    return (rank * nq * head_dim, (rank + 1) * nq * head_dim), (kv0 * head_dim, (kv0 + nkv) * head_dim)


def qkv_shard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, world: int, head_dim: int, *,
              block: Block = (BLOCK, BLOCK), name: str = "qkv_proj") -> tuple[torch.Tensor, torch.Tensor]:
    """Engine rank ``rank``'s FP8 qkv_proj from the full HF q_proj, k_proj, v_proj weights: [its q heads; its k
    head(s); its v head(s)], kv heads replicated when ``world`` exceeds their number; scales likewise."""
    if q.shape[0] % head_dim or k.shape[0] % head_dim or k.shape != v.shape:
        raise ValueError(f"fp8 qkv: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} are not whole "
                         f"heads of {head_dim} rows with k and v alike")
    (q0, q1), (kv0, kv1) = qkv_rows(q.shape[0] // head_dim, k.shape[0] // head_dim, head_dim, rank, world)
    return merged_rows([(q, q0, q1), (k, kv0, kv1), (v, kv0, kv1)], block=block, name=name)


def gate_up_shard(gate: torch.Tensor, up: torch.Tensor, rank: int, world: int, *, block: Block = (BLOCK, BLOCK),
                  name: str = "gate_up_proj") -> tuple[torch.Tensor, torch.Tensor]:
    """Engine rank ``rank``'s FP8 gate_up_proj: [its gate rows; its up rows], each part on its own block grid."""
    window = tp_range(gate.shape[0], rank, world, f"the rows of {name}'s gate")
    return merged_rows([(gate, *window), (up, *window)], block=block, name=name)


def layout_problems(spec: ModelSpec, rollout_tp: int, block: int = BLOCK) -> list[str]:
    """Why the engines' FP8 loaders would refuse this model at this engine TP (their block-quant shape check,
    ``validate_fp8_block_shape``): each part of a merged layer's per-rank output (q, k, v; gate, up) must be a
    multiple of the block, and with TP > 1 so must each row-parallel layer's per-rank input (o_proj's and
    down_proj's columns). Empty: the shapes load. (Newer SGLang lets a merged layer's last part be partial at TP 1;
    this check does not, to hold for every version.)"""
    R, d = rollout_tp, spec.head_dim
    nkv = spec.num_kv_heads // R if R <= spec.num_kv_heads else 1
    inter = spec.ffn_size(spec.is_moe) // R
    sizes = {"q_proj rows per engine rank": spec.num_attention_heads // R * d,
             "k_proj/v_proj rows per engine rank": nkv * d, "gate_proj/up_proj rows per engine rank": inter}
    if R > 1:
        sizes |= {"o_proj columns per engine rank": spec.num_attention_heads // R * d,
                  "down_proj columns per engine rank": inter}
    return [f"{what} = {n} is not a multiple of the FP8 block {block}" for what, n in sizes.items() if n % block]


QUANTIZED = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")
"""The engine tensors an FP8 rollout quantizes (name suffixes): the linear layers' weights, nothing else."""


def scale_name(name: str) -> str:
    """The engine's scale tensor of FP8 weight ``name``: SGLang's (and vLLM's) ``...weight_scale_inv``."""
    assert name.endswith(".weight"), name
    return name + "_scale_inv"


@dataclass(frozen=True, slots=True)
class Fp8Part:
    """A window of full HF weight ``hf`` (rows [rows[0], rows[1]) x columns [cols[0], cols[1])) that fills the
    engine weight's rows [dst_row, dst_row + its rows), every column, and whose block scales fill rows
    [scale_row, scale_row + its block rows) of the engine's ``weight_scale_inv``, every column. The window starts on
    the block grid and ends on it or at the weight's end, so its blocks are the full weight's (``engine_geometry``
    checks it)."""

    hf: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    dst_row: int
    scale_row: int

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclass(frozen=True, slots=True)
class Fp8Tensor:
    """One quantized engine tensor of one engine rank: ``name`` (float8_e4m3fn, ``shape``) and ``scale_name``
    (float32, ``scale_shape``: one scale per ``block``), filled part by part (q, k, v; gate, up; or one window)."""

    name: str
    scale_name: str
    shape: tuple[int, int]
    scale_shape: tuple[int, int]
    block: Block
    parts: tuple[Fp8Part, ...]

    def quantize(self, source: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> None:
        """``source`` (the engine rank's window in the trainer's dtype, of ``shape``: the gathered copy or the
        trainer's own tensor) quantized into ``weight`` and ``scales`` (the engine's parameters), part by part."""
        br = self.block[0]
        for part in self.parts:
            n = part.num_rows
            quantize(source.narrow(0, part.dst_row, n), out=weight.narrow(0, part.dst_row, n),
                     scales=scales.narrow(0, part.scale_row, _ceil(n, br)), block=self.block,
                     name=f"{self.name} <- {part.hf}")


def _aligned(begin: int, end: int, full: int, block: int) -> bool:
    return begin % block == 0 and (end % block == 0 or end == full)


def engine_geometry(tensor: EngineTensor, hf_shapes: dict[str, tuple[int, ...]],
                    block: Block = (BLOCK, BLOCK)) -> Fp8Tensor | None:
    """The block geometry of engine tensor ``tensor`` if an FP8 rollout quantizes it (None: it stays as trained).
    ``hf_shapes``: the full HF weights' shapes (megarl.models.mapping.hf_shapes). Raises UserError for a window that
    cuts a block (the engines' loaders refuse those shapes too: ``layout_problems``)."""
    if not tensor.name.endswith(QUANTIZED):
        return None
    if len(tensor.shape) != 2:
        raise UserError(f"rollout.weight_dtype = fp8: engine tensor `{tensor.name}` has shape {list(tensor.shape)}; "
                        "only 2-D linear weights are quantized")
    rows, cols = tensor.shape
    parts = []
    for piece in tensor.pieces:
        full = hf_shapes[piece.hf]
        if piece.dim == 0:
            window, columns = (piece.start, piece.stop), (0, full[1])
            dst_row = piece.offset
        else:
            window, columns = (0, full[0]), (piece.start, piece.stop)
            dst_row = 0
        span = (window[1] - window[0], columns[1] - columns[0])
        if (not _aligned(*window, full[0], block[0]) or not _aligned(*columns, full[1], block[1])
                or dst_row % block[0] or span[1] != cols):
            raise UserError(f"rollout.weight_dtype = fp8: engine tensor `{tensor.name}` holds rows {list(window)} x "
                            f"columns {list(columns)} of `{piece.hf}` {list(full)}, which cut its {block[0]} x "
                            f"{block[1]} blocks; the engines' FP8 loaders refuse such shapes (fp8.layout_problems). "
                            "Use another rollout.tensor_parallel or rollout.fp8_block, or rollout.weight_dtype: bf16.")
        parts.append(Fp8Part(piece.hf, window, columns, dst_row, dst_row // block[0]))
    if sum(p.num_rows for p in parts) != rows:
        raise UserError(f"rollout.weight_dtype = fp8: the parts of `{tensor.name}` do not fill its {rows} rows")
    return Fp8Tensor(tensor.name, scale_name(tensor.name), (rows, cols),
                     (sum(_ceil(p.num_rows, block[0]) for p in parts), _ceil(cols, block[1])), block, tuple(parts))
