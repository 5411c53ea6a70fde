"""Verified hand-over (``rollout.verify_every``): after an update every engine rank checksums its parameters
inside the engine, and the trainer compares them with checksums it computes from its own tensors and the plan.

The checksum of a tensor: each element's bit pattern as an integer, weighted by a function of the element's
flat position, summed modulo the prime 2^31 - 1, under two weightings (62 bits). The position weights catch
rows, heads or columns in the wrong place, not only wrong values. Integer sums modulo a prime are exact and
independent of order, so every trainer rank adds up the slices its tensors are the origin of
(``planner.Transfer.src_rank``, those another GPU forwards included) and one all-reduce totals them: no
engine tensor is ever assembled on the trainer's side. This module also runs inside
the engine process (megarl.reshard.handover): it imports torch, megarl.errors and megarl.reshard.kernels only (the
planner's types for annotations). The sums run in megarl._C (csrc/verify), one pass over each block of elements.
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

PRIME = 2**31 - 1
MULTIPLIERS = (16807, 48271)
"""Two position weightings, w(i) = (i * a mod PRIME) + 1 (csrc/verify/checksum_math.h computes them)."""


def _block(t: torch.Tensor, offset: int, row_stride: int, num_rows: int, run: int, first: int,
           position_stride: int) -> torch.Tensor:
    """The checksum part of ``num_rows`` rows of ``run`` elements of ``t`` (contiguous), row r from element
    offset + r * row_stride, its element c at position first + r * position_stride + c (megarl._C.checksum)."""
    return extension().checksum(t.detach(), offset, row_stride, num_rows, run, first, position_stride)


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """int64 [2], each in [0, PRIME): the checksum of a whole tensor."""
    t = t.contiguous()
    return _block(t, 0, t.numel(), 1, t.numel(), 0, t.numel())


def slice_checksum(src: torch.Tensor, t: Transfer, dst_shape: tuple[int, ...]) -> torch.Tensor:
    """The part of the checksum of engine tensor ``t.dst_name`` (of ``dst_shape``) that transfer ``t`` writes,
    computed from the trainer tensor ``src`` it reads."""
    columns = dst_shape[-1] if len(dst_shape) > 1 else 1  # as a matrix (megarl.reshard.engine_layout.matrix_shape)
    if t.dim == 0:
        row = src[0].numel() if src.dim() > 1 else 1
        run = t.length * row
        return _block(src, t.src_offset * row, run, 1, run, t.dst_offset * columns, run)
    # A column slice of a block of rows: positions r * columns + dst_offset + c.
    return _block(src, t.src_offset, src.shape[1], src.shape[0], t.length, t.dst_offset, columns)


def engine_names(plan: Plan) -> list[list[str]]:
    """Per GPU (global rank), the engine tensors the refit writes there, sorted: the order of
    ``Resharder.dst_names`` on that rank, and of the engine's checksums."""
    names: list[set[str]] = [set() for _ in range(plan.num_gpus)]
    for bucket in plan.buckets:
        for t in bucket:
            names[t.dst_rank].add(t.dst_name)
    return [sorted(n) for n in names]


def spans_processes(plan: Plan, group: dist.ProcessGroup | None) -> bool:
    """Whether the hand-over's collectives have other processes to reach: over ``group``, or the world where there
    is one (an engine worker outside the trainer's world has only its group)."""
    return (group is not None or dist.is_initialized()) and plan.num_gpus > 1


def expected_checksums(plan: Plan, rank: int, src: dict[str, torch.Tensor],
                       group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> torch.Tensor:
    """int64 [num names, 2]: the checksums this rank's engine rank must report, in ``engine_names(plan)[rank]``
    order. Collective over ``group`` (None: the world): every rank adds the slices it is the origin of.
    ``device``: where the sums are made (None: that of ``src``, which an engine's own GPU does not have)."""
    per_gpu = engine_names(plan)
    row: dict[tuple[int, str], int] = {}
    for g, names in enumerate(per_gpu):
        base = len(row)
        row |= {(g, n): base + i for i, n in enumerate(names)}
    device = device or next(iter(src.values())).device
    partial = torch.zeros(len(row), 2, dtype=torch.int64, device=device)
    for bucket in plan.buckets:
        for t in bucket:
            if t.src_rank == rank:
                shape = plan.engine_shapes(t.dst_rank)[t.dst_name]
                k = row[t.dst_rank, t.dst_name]
                partial[k] = (partial[k] + slice_checksum(src[t.src_name], t, shape)) % PRIME
    if spans_processes(plan, group):
        dist.all_reduce(partial, group=group)  # num_gpus * PRIME stays far below 2^63
    first = row[rank, per_gpu[rank][0]] if per_gpu[rank] else 0
    return partial[first:first + len(per_gpu[rank])] % PRIME


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

