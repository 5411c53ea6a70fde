"""Typed front door to the compiled kernels in megarl._C, plus a pure-torch reference.

A segment copies `num_rows` rows of `row_bytes` bytes from one tensor to another, each side
with its own byte offset and row stride. Packing many tensor slices into a flat buffer,
unpacking them again, and regrouping a layout (a column slice of a matrix, reordered head
blocks) are all lists of segments, which the extension runs in one pass.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import NamedTuple, Protocol

import torch

from megarl.errors import UserError


class Segment(NamedTuple):
    """One row of a segment table. Offsets, strides and sizes are in bytes."""

    src_index: int
    src_offset: int
    src_stride: int
    dst_index: int
    dst_offset: int
    dst_stride: int
    num_rows: int
    row_bytes: int


class SegmentCopy(Protocol):
    """A validated copy (megarl._C.SegmentCopy) that `run()` replays with no host work but the launch.

    It keeps its tensors alive and the addresses they had when built; `run()` first checks that every
    storage still has them and refuses, naming the tensor, after anything that freed, moved or swapped a
    tensor's storage (an offload's resize_(0), set_, `.data =`): build a new one.
    """

    @property
    def num_segments(self) -> int: ...

    @property
    def total_bytes(self) -> int: ...

    def run(self) -> None: ...


def extension() -> ModuleType:
    """megarl._C, imported on first use so that pure-Python code runs without a build."""
    try:
        return importlib.import_module("megarl._C")
    except ImportError as err:
        raise ImportError(
            f"megarl._C, megarl's compiled extension, cannot be imported ({err}). Build it from the "
            "repository root, with torch already installed: pip install --no-build-isolation -e ."
        ) from err


def check_cuda_build() -> None:
    """On a GPU, megarl._C must hold its CUDA kernels: one built on a machine without a GPU (a login node) has only
    the CPU ones, which the first weight hand-over would find after a whole rollout and update."""
    if not extension().with_cuda():
        raise UserError(
            "megarl._C was built without its CUDA kernels (on a machine without a GPU or nvcc, such as a login "
            "node), but this run is on GPUs: the weight hand-over would fail after the first step. Fix: rebuild it "
            "where nvcc is found (pip install --no-build-isolation -e . on a GPU node, or with MEGARL_FORCE_CUDA=1 "
            "on a build machine without a GPU).")


def segment_table(segments: Iterable[Segment]) -> torch.Tensor:
    """The int64 CPU [n, 8] table the kernels take; columns in Segment's field order."""
    rows = [tuple(s) for s in segments]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(Segment._fields))


def _as_table(table: torch.Tensor | Iterable[Segment]) -> torch.Tensor:
    return table if isinstance(table, torch.Tensor) else segment_table(table)


def copy_segments(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: torch.Tensor | Iterable[Segment],
    src_names: Sequence[str] = (), dst_names: Sequence[str] = (),
) -> None:
    """Copy every segment; the whole table is validated before any byte moves.

    All tensors must be contiguous, on one device and hold their memory (not offloaded); CUDA copies run on the
    current stream. Segments must not write the same destination byte, nor read a byte that a segment writes (a
    segment copying bytes onto themselves excepted): both are refused. Names, one per tensor, name the tensors in
    errors.
    """
    extension().copy_segments(list(srcs), list(dsts), _as_table(table), list(src_names), list(dst_names))


def make_segment_copy(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: torch.Tensor | Iterable[Segment],
    src_names: Sequence[str] = (), dst_names: Sequence[str] = (),
) -> SegmentCopy:
    """Validate once and, on CUDA, upload the segment table; `.run()` then repeats the copy. Names, one per
    tensor (a parameter's), name the tensors in the errors of both."""
    copier: SegmentCopy = extension().SegmentCopy(list(srcs), list(dsts), _as_table(table), list(src_names),
                                                   list(dst_names))
    return copier


def packed_offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Byte offset of each tensor when packed back to back, then the total size."""
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + t.nbytes)
    return offsets


def _whole_tensor_segments(tensors: Sequence[torch.Tensor], into_flat: bool) -> list[Segment]:
    segments = []
    for i, (t, offset) in enumerate(zip(tensors, packed_offsets(tensors), strict=False)):
        n = t.nbytes
        if into_flat:
            segments.append(Segment(i, 0, n, 0, offset, n, 1, n))
        else:
            segments.append(Segment(0, offset, n, i, 0, n, 1, n))
    return segments


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> list[int]:
    """Copy whole contiguous tensors back to back into `out`; returns packed_offsets(tensors)."""
    copy_segments(tensors, [out], _whole_tensor_segments(tensors, into_flat=True))
    return packed_offsets(tensors)


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[int]:
    """Inverse of pack: fill each tensor from its place in `flat`; returns packed_offsets(tensors)."""
    copy_segments([flat], tensors, _whole_tensor_segments(tensors, into_flat=False))
    return packed_offsets(tensors)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():  # reshape would copy it, and a write would land in the copy
        raise ValueError(f"copy_segments_reference takes contiguous tensors (as copy_segments does); got one of shape "
                         f"{list(t.shape)} with strides {list(t.stride())}")
    return t.view(-1).view(torch.uint8)


def copy_segments_reference(
    srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: torch.Tensor | Iterable[Segment]
) -> None:
    """The specification of copy_segments, written with torch views; slow, for tests.

    Checks bounds and raises ValueError naming the segment, and contiguity, but not devices.
    """
    for i, row in enumerate(_as_table(table).tolist()):
        s = Segment(*row)
        if min(s) < 0:
            raise ValueError(f"segment {i} has a negative field: {s}")
        if s.num_rows == 0 or s.row_bytes == 0:
            continue
        src = _byte_view(srcs[s.src_index])
        dst = _byte_view(dsts[s.dst_index])
        for offset, stride, side in ((s.src_offset, s.src_stride, src), (s.dst_offset, s.dst_stride, dst)):
            if offset + (s.num_rows - 1) * stride + s.row_bytes > side.numel():
                raise ValueError(f"segment {i} reaches past the end of its {side.numel()}-byte tensor: {s}")
        for r in range(s.num_rows):
            d0 = s.dst_offset + r * s.dst_stride
            s0 = s.src_offset + r * s.src_stride
            dst[d0 : d0 + s.row_bytes] = src[s0 : s0 + s.row_bytes]
