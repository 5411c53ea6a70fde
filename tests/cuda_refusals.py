"""Every case megarl._C refuses, on CUDA tensors, for a run under compute-sanitizer (issue 56 items 2 and 3):

  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 99 python tests/cuda_refusals.py

(without the caching allocator, a write into memory an offload freed is a write the sanitizer sees).

Each case must raise a RuntimeError with the expected words before any kernel touches memory that is not its
tensors'; a few valid copies and checksums (ragged tiles, strided blocks, 8-byte halves) run beside them so the
sanitizer also sees the kernels at work. Exits 0 when every case is refused as expected and the valid ones agree
with the CPU, 1 otherwise (99: the sanitizer found an access error).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from megarl.reshard.kernels import Segment, copy_segments, extension, make_segment_copy, segment_table
from megarl.reshard.verify import tensor_checksum


def offloaded(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(0)  # what megarl.memory.offload does to a tensor it moved off the device
    return t


def byte_tensors(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, device="cuda").to(torch.uint8), torch.zeros(n, dtype=torch.uint8, device="cuda")


def refusals() -> list[tuple[str, str, Callable[[], object]]]:
    """(case, words the error must hold, what raises)."""
    C = extension()
    ten = torch.zeros(10, device="cuda")
    src, dst = byte_tensors(256)
    overlapping = segment_table([Segment(0, 0, 8, 0, 0, 10, 8, 4), Segment(0, 0, 8, 0, 71, 7, 3, 2)])
    whole = [Segment(0, 0, 0, 0, 0, 0, 1, 256)]
    freed_src, freed_dst = byte_tensors(256)
    freed = make_segment_copy([freed_src], [freed_dst], whole, dst_names=["model.layers.0.mlp.down_proj.weight"])
    freed.run()
    offloaded(freed_dst)
    moved_src, moved_dst = byte_tensors(256)
    moved = make_segment_copy([moved_src], [moved_dst], whole, src_names=["decoder.final_layernorm.weight"])
    moved.run()
    moved_src.data = torch.zeros(256, dtype=torch.uint8, device="cuda")
    return [
        ("checksum: row stride wrapping int64", "run past", lambda: C.checksum(ten, 0, 2**62, 5, 1, 0, 1)),
        ("checksum: offset wrapping int64", "run past", lambda: C.checksum(ten, 2**63 - 1, 1, 1, 1, 0, 1)),
        ("checksum: positions wrapping int64", "overflow", lambda: C.checksum(ten, 0, 1, 2, 1, 0, 2**62)),
        ("checksum: storage resized to 0", "`lm_head.weight` has no memory",
         lambda: tensor_checksum(offloaded(torch.ones(1024, device="cuda")), "lm_head.weight")),
        ("copy: row stride wrapping int64", "overflow",
         lambda: copy_segments([src], [dst], [Segment(0, 0, 2**62, 0, 0, 16, 5, 16)])),
        ("copy: overlapping destinations", "write the same bytes", lambda: copy_segments([src], [dst], overlapping)),
        ("SegmentCopy: overlapping destinations", "write the same bytes",
         lambda: make_segment_copy([src], [dst, dst[64:]], [Segment(0, 0, 0, 0, 70, 0, 1, 2),
                                                            Segment(0, 0, 0, 1, 0, 0, 1, 16)])),
        ("SegmentCopy: destination resized to 0", "`model.norm.weight`) has no memory",
         lambda: make_segment_copy([src], [offloaded(byte_tensors(256)[1])], whole, dst_names=["model.norm.weight"])),
        ("SegmentCopy.run: destination freed after the build", "`model.layers.0.mlp.down_proj.weight`) no longer",
         freed.run),
        ("SegmentCopy.run: source replaced after the build", "`decoder.final_layernorm.weight`) no longer", moved.run),
        ("BufferPool: size wrapping int64", "overflow a 64-bit size", lambda: C.BufferPool(4, 2**62, "cuda")),
    ]


def valid_work() -> list[str]:
    """Copies and checksums that must run clean and agree with the CPU; returns what disagreed."""
    torch.manual_seed(0)
    bad = []
    matrix = torch.randn(513, 1001)
    for name, block in [
        ("ragged float32 block", (matrix, 3, 1001, 513, 997, 2**45 + 1, 2**33)),
        ("int64 halves", (matrix[:, :1000].contiguous().view(torch.int64), 1, 500, 512, 499, 5, 500)),
        ("uint8 one row", (matrix.view(torch.uint8), 7, 0, 1, 2_000_000, 0, 0)),
        ("bfloat16 tail under one tile", (matrix.to(torch.bfloat16), 0, 1001, 3, 31, 0, 77)),
    ]:
        if extension().checksum(block[0].cuda(), *block[1:]).tolist() != extension().checksum(*block).tolist():
            bad.append(f"checksum of a {name}")
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
    segments = [Segment(0, 1, 2048, 0, 0, 1024, 500, 1000), Segment(0, 5, 0, 0, 1000, 1024, 1, 24)]
    expected = torch.zeros(1 << 20, dtype=torch.uint8)
    copy_segments([src], [expected], segments)
    got = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    make_segment_copy([src.cuda()], [got], segments).run()
    if not torch.equal(got.cpu(), expected):
        bad.append("a SegmentCopy run")
    return bad


def main() -> int:
    if not torch.cuda.is_available() or not extension().with_cuda():
        print("needs a GPU and megarl._C built with CUDA (pip install --no-build-isolation -e .)")
        return 1
    failed = 0
    for case, words, call in refusals():
        try:
            call()
            outcome = "NOT REFUSED"
        except RuntimeError as err:
            outcome = "refused" if words in str(err) else f"refused with another message: {str(err)[:300]}"
        torch.cuda.synchronize()  # a kernel that ran anyway shows its fault here, under the case that launched it
        failed += outcome != "refused"
        print(f"{outcome:>8}  {case}")
    for what in valid_work():
        failed += 1
        print(f"DIFFERS   {what} on CUDA and CPU")
    torch.cuda.synchronize()
    print("all refused cleanly" if failed == 0 else f"{failed} case(s) failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
