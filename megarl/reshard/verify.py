"""Verified hand-over (``rollout.verify_every``): after an update every engine rank checksums its parameters
inside the engine, and the trainer compares them with checksums it computes from its own tensors and the plan.

The checksum of a tensor, for each of two primes p (2^32 - 5 and 2^32 - 17, 64 bits together) with a primitive
root r of each: the sum of u * r^i mod p over its elements, u an element's bit pattern as an unsigned integer (an
8-byte element as its two 4-byte halves at positions 2i and 2i + 1) and i its flat position. Every bit pattern
counts (NaN payloads too), and the position weights catch rows, heads or columns in the wrong place, not only
wrong values: a swap of two different elements changes at least one sum at any distance below 2^62 (but for
4-byte patterns that differ by a prime, csrc/verify/checksum_math.h says why). Integer sums modulo a prime are
exact and independent of order, so every trainer rank adds up the slices its tensors are the origin of
(``planner.Transfer.src_rank``, those another GPU forwards included) and one all-reduce totals them: no engine
tensor is ever assembled on the trainer's side. This module also runs inside
the engine process (megarl.reshard.handover): it imports torch, megarl.errors and megarl.reshard.kernels only (the
planner's types for annotations; the FP8 reference where the trainer computes FP8 checksums). The sums run in
megarl._C (csrc/verify), one pass over each block of elements.

FP8 rollout (``plan.fp8``): an engine tensor held in FP8 is checksummed as its float8 bytes and, as a tensor of its
own, its float32 ``weight_scale_inv``. Those are no sum of slices, so the trainer gathers the tensor's window in its
own dtype on the GPU that holds it (the slices' bits, summed as integers over the group: exact) and quantizes it
there with the float64 reference (megarl.reshard.fp8_reference), not with the kernel the hand-over ran: a wrong
quantization, not only a wrong copy, fails the check. That costs a gather of every FP8 tensor per verified
hand-over, one collective per engine tensor and GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.errors import HandoverMismatch
from megarl.reshard.kernels import extension

if TYPE_CHECKING:
    from megarl.reshard.planner import Plan
    from megarl.reshard.transfers import Transfer

PRIMES = (2**32 - 5, 2**32 - 17)
BASES = (0x9E3779B9, 0xC2B2AE35)
"""Position weights r^i mod p, one base per prime (csrc/verify/checksum_math.h computes them)."""


def _block(t: torch.Tensor, offset: int, row_stride: int, num_rows: int, run: int, first: int,
           position_stride: int, name: str = "") -> torch.Tensor:
    """The checksum part of ``num_rows`` rows of ``run`` elements of ``t`` (contiguous), row r from element
    offset + r * row_stride, its element c at position first + r * position_stride + c (megarl._C.checksum).
    ``name`` names the tensor in errors (an offloaded one is refused)."""
    return extension().checksum(t.detach(), offset, row_stride, num_rows, run, first, position_stride, name)


def reduce_sums(sums: torch.Tensor) -> torch.Tensor:
    """Checksums ([..., 2], sums of any number of parts below 2^63) reduced by their primes."""
    return sums % torch.tensor(PRIMES, dtype=torch.int64, device=sums.device)


def tensor_checksum(t: torch.Tensor, name: str = "") -> torch.Tensor:
    """int64 [2], below PRIMES: the checksum of a whole tensor. ``name`` (the parameter's) names it in errors."""
    t = t.contiguous()
    return _block(t, 0, t.numel(), 1, t.numel(), 0, t.numel(), name)


def slice_checksum(src: torch.Tensor, t: Transfer, dst_shape: tuple[int, ...]) -> torch.Tensor:
    """The part of the checksum of engine tensor ``t.dst_name`` (of ``dst_shape``) that transfer ``t`` writes,
    computed from the trainer tensor ``src`` it reads."""
    columns = dst_shape[-1] if len(dst_shape) > 1 else 1  # as a matrix (megarl.reshard.engine_layout.matrix_shape)
    if t.dim == 0:
        row = src[0].numel() if src.dim() > 1 else 1
        run = t.length * row
        return _block(src, t.src_offset * row, run, 1, run, t.dst_offset * columns, run, t.src_name)
    # A column slice of a block of rows: positions r * columns + dst_offset + c.
    return _block(src, t.src_offset, src.shape[1], src.shape[0], t.length, t.dst_offset, columns, t.src_name)


def engine_names(plan: Plan) -> list[list[str]]:
    """Per GPU (global rank), the engine tensors the refit writes there, sorted, with the scales of those held in FP8:
    the order of ``Resharder.checksum_names`` on that rank, and of the engine's checksums."""
    names: list[set[str]] = [set() for _ in range(plan.num_gpus)]
    for bucket in plan.buckets:
        for t in bucket:
            names[t.dst_rank].add(t.dst_name)
    for g, n in enumerate(names):
        n |= {f.scale_name for f in plan.fp8_tensors(g).values()}
    return [sorted(n) for n in names]


def spans_processes(plan: Plan, group: dist.ProcessGroup | None) -> bool:
    """Whether the hand-over's collectives have other processes to reach: over ``group``, or the world where there
    is one (an engine worker outside the trainer's world has only its group)."""
    return (group is not None or dist.is_initialized()) and plan.num_gpus > 1


def expected_checksums(plan: Plan, rank: int, src: dict[str, torch.Tensor],
                       group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """int64 [num names, 2]: the checksums this rank's engine rank must report, in ``engine_names(plan)[rank]``
    order. Collective over ``group`` (None: the world): every rank adds the slices it is the origin of.
    ``device``: where the sums are made (None: that of ``src``, which an engine's own GPU does not have).
    ``dtype``: the trainer's (None: that of ``src``), whose bits an FP8 tensor's window holds."""
    per_gpu = engine_names(plan)
    row: dict[tuple[int, str], int] = {}
    for g, names in enumerate(per_gpu):
        base = len(row)
        row |= {(g, n): base + i for i, n in enumerate(names)}
    device = device or next(iter(src.values())).device
    partial = torch.zeros(len(row), 2, dtype=torch.int64, device=device)
    for bucket in plan.buckets:
        for t in bucket:
            if t.src_rank == rank and t.dst_name not in plan.fp8_tensors(t.dst_rank):
                shape = plan.engine_shapes(t.dst_rank)[t.dst_name]
                k = row[t.dst_rank, t.dst_name]
                partial[k] = reduce_sums(partial[k] + slice_checksum(src[t.src_name], t, shape))
    if plan.fp8:
        _fp8_checksums(plan, rank, src, group, device, partial, row,
                       dtype or (next(iter(src.values())).dtype if src else None))
    if spans_processes(plan, group):
        dist.all_reduce(partial, group=group)  # num_gpus * 2^32 stays far below 2^63
    first = row[rank, per_gpu[rank][0]] if per_gpu[rank] else 0
    return reduce_sums(partial[first:first + len(per_gpu[rank])])


def _fp8_checksums(plan: Plan, rank: int, src: dict[str, torch.Tensor], group: dist.ProcessGroup | None,
                   device: torch.device, partial: torch.Tensor, row: dict[tuple[int, str], int],
                   dtype: torch.dtype | None) -> None:
    """Into ``partial``: on each GPU, the checksums of its FP8 tensors and scales as the reference quantizes the
    window of the trainer's weights that the plan gathers there (module docstring). Collective over ``group``."""
    from megarl.reshard.fp8_reference import quantize as reference

    into: dict[tuple[int, str], list[Transfer]] = {}
    for bucket in plan.buckets:
        for t in bucket:
            if t.dst_name in plan.fp8_tensors(t.dst_rank):
                into.setdefault((t.dst_rank, t.dst_name), []).append(t)
    collective = spans_processes(plan, group)
    for g in range(plan.num_gpus):
        for name, geometry in sorted(plan.fp8_tensors(g).items()):
            # The window's bit patterns, each origin adding its slices (zeros elsewhere): integers, summed exactly.
            bits = torch.zeros(geometry.shape, dtype=torch.int64, device=device)
            for t in into.get((g, name), []):
                if t.src_rank != rank:
                    continue
                s = src[t.src_name]
                as_int = s.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[s.element_size()]).view(s.shape)
                if t.dim == 0:
                    bits[t.dst_offset:t.dst_offset + t.length] = as_int[t.src_offset:t.src_offset + t.length]
                else:
                    bits[:, t.dst_offset:t.dst_offset + t.length] = as_int[:, t.src_offset:t.src_offset + t.length]
            if collective:
                dist.reduce(bits, op=dist.ReduceOp.SUM, group=group, group_dst=g) if group is not None else \
                    dist.reduce(bits, dst=g, op=dist.ReduceOp.SUM)
            if g != rank:
                continue
            assert dtype is not None, "the trainer's dtype, which the FP8 tensors' windows hold, is needed"
            window = bits.to({1: torch.int8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]).view(dtype)
            weight = torch.empty(geometry.shape, dtype=torch.float8_e4m3fn)
            scales = torch.empty(geometry.scale_shape, dtype=torch.float32)
            for part in geometry.parts:
                n, br = part.num_rows, geometry.block[0]
                q, sc = reference(window[part.dst_row:part.dst_row + n].cpu(), geometry.block)
                weight[part.dst_row:part.dst_row + n] = q
                scales[part.scale_row:part.scale_row + -(-n // br)] = sc
            partial[row[g, name]] = tensor_checksum(weight.to(device), name)
            partial[row[g, geometry.scale_name]] = tensor_checksum(scales.to(device), geometry.scale_name)


def mismatched(names: list[str], expected: torch.Tensor, reported: torch.Tensor) -> list[str]:
    """The tensors whose reported checksum differs from the expected one."""
    differ = (expected.cpu() != reported.cpu()).any(dim=1).tolist()
    return [n for n, bad in zip(names, differ, strict=True) if bad]


def check_reports(handover: int, mismatched_per_gpu: list[list[str]]) -> None:
    """Raise HandoverMismatch naming every GPU's mismatched tensors (``mismatched`` on each, in rank order)."""
    failed = [f"GPU {g}: {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
              for g, names in enumerate(mismatched_per_gpu) if names]
    if failed:
        raise HandoverMismatch(
            f"hand-over {handover}: the engine's parameters differ from the actor's weights (by checksum, "
            f"rollout.verify_every) on {'; '.join(failed)}. Training stopped before the engine generated with "
            "them; the last complete checkpoint is intact. This is a bug in megarl's hand-over or in the engine: "
            "please report it with this message (rollout.verify_every: 0 skips the check).")

