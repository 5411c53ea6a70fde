"""megarl._C segment copies against the pure-torch reference in megarl.reshard.kernels."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import torch

from megarl.reshard import kernels
from megarl.reshard.kernels import Segment

C = kernels.extension()

Tensors = list[torch.Tensor]


def random_tensor(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # clone: frombuffer shares the bytearray's memory, whose alignment is malloc's, not torch's.
    raw = torch.frombuffer(bytearray(rng.randbytes(nbytes)), dtype=torch.uint8).clone()
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Byte view, so that NaN bit patterns in random float data still compare equal."""
    return t.reshape(-1).view(torch.uint8)


def same_bytes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(a, b, strict=True))


def tensor_zoo(rng: random.Random, scale: int) -> Tensors:
    """Mixed dtypes and shapes, plus a view whose data pointer is odd (storage offset 1)."""
    odd = random_tensor(rng, (scale * 1000 + 1,), torch.uint8)[1:]
    return [
        random_tensor(rng, (scale * 64, 48), torch.float32),
        random_tensor(rng, (scale * 96, 33), torch.bfloat16),
        random_tensor(rng, (scale * 5000 + 7,), torch.int8),
        odd,
    ]


def span(rows: int, stride: int, row_bytes: int) -> int:
    return 0 if rows == 0 or row_bytes == 0 else (rows - 1) * stride + row_bytes


def random_segments(
    rng: random.Random, srcs: Tensors, dsts: Tensors, count: int, align: int, max_row_bytes: int
) -> list[Segment]:
    """Random in-bounds segments. Destinations are laid out one after another, so they never
    overlap; sources may overlap, repeat rows (stride 0) or interleave."""
    cursor = [0] * len(dsts)
    segments = []
    for _ in range(count):
        si, di = rng.randrange(len(srcs)), rng.randrange(len(dsts))
        rows = rng.choice([0, 1, 1, 2, 3, 7, 16, 33])
        row_bytes = align * rng.randint(0, max_row_bytes // align)
        dst_stride = row_bytes + align * rng.randint(0, 3)
        src_stride = align * rng.randint(0, 2 * max_row_bytes // align)
        dst_offset = cursor[di] + align * rng.randint(0, 3)
        fits_dst = dst_offset + span(rows, dst_stride, row_bytes) <= dsts[di].nbytes
        fits_src = span(rows, src_stride, row_bytes) <= srcs[si].nbytes
        if not (fits_dst and fits_src):
            rows = 0
        src_room = srcs[si].nbytes - span(rows, src_stride, row_bytes)
        src_offset = align * rng.randint(0, max(src_room, 0) // align)
        cursor[di] = dst_offset + span(rows, dst_stride, row_bytes)
        cursor[di] += -cursor[di] % align
        segments.append(Segment(si, src_offset, src_stride, di, dst_offset, dst_stride, rows, row_bytes))
    return segments


Runner = Callable[[Tensors, Tensors, torch.Tensor], None]


def run_one_shot(srcs: Tensors, dsts: Tensors, table: torch.Tensor) -> None:
    C.copy_segments(srcs, dsts, table)


def run_planned(srcs: Tensors, dsts: Tensors, table: torch.Tensor) -> None:
    C.SegmentCopy(srcs, dsts, table).run()


RUNNERS = [pytest.param(run_one_shot, id="copy_segments"), pytest.param(run_planned, id="SegmentCopy")]


def check_against_reference(
    runner: Runner, srcs: Tensors, dsts: Tensors, segments: list[Segment], device: str = "cpu"
) -> None:
    """Runs on `device` from identical starting destinations; the reference runs on CPU."""
    table = kernels.segment_table(segments)
    expected = [d.clone() for d in dsts]
    kernels.copy_segments_reference(srcs, expected, table)
    got = [d.to(device) for d in dsts]
    runner([s.to(device) for s in srcs], got, table)
    if device != "cpu":
        torch.cuda.synchronize()
    assert same_bytes([g.cpu() for g in got], expected)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("align", [1, 2, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_tables_match_reference(runner: Runner, align: int, seed: int) -> None:
    rng = random.Random(seed * 31 + align)
    srcs, dsts = tensor_zoo(rng, 4), tensor_zoo(rng, 8)
    check_against_reference(runner, srcs, dsts, random_segments(rng, srcs, dsts, 80, align, 600))


@pytest.mark.parametrize("runner", RUNNERS)
def test_column_slice_and_head_regroup(runner: Runner) -> None:
    rng = random.Random(7)
    rows, cols, head, heads = 40, 24, 5, 6
    matrix = random_tensor(rng, (rows, cols), torch.bfloat16)
    qkv = random_tensor(rng, (heads * head, 16), torch.float32)
    item, head_bytes = matrix.element_size(), head * qkv[0].nbytes
    column_slice = torch.zeros(rows, 7, dtype=torch.bfloat16)
    regrouped = torch.zeros_like(qkv)
    order = [3, 0, 5, 1, 4, 2]
    segments = [Segment(0, 9 * item, cols * item, 0, 0, 7 * item, rows, 7 * item)]
    segments += [
        Segment(1, h * head_bytes, 0, 1, i * head_bytes, 0, 1, head_bytes) for i, h in enumerate(order)
    ]
    check_against_reference(runner, [matrix, qkv], [column_slice, regrouped], segments)
    assert same_bytes([column_slice], [matrix[:, 9:16].contiguous()])
    assert same_bytes([regrouped], [qkv.view(heads, head, 16)[order]])


@pytest.mark.parametrize("runner", RUNNERS)
def test_large_segments_split_across_threads(runner: Runner) -> None:
    rng = random.Random(3)
    big = random_tensor(rng, (3 << 20,), torch.uint8)
    dst = torch.zeros(8 << 20, dtype=torch.uint8)
    segments = [
        Segment(0, 1, 0, 0, 5, 0, 1, (3 << 20) - 1),
        Segment(0, 3, 1000, 0, 4 << 20, 1001, 3000, 997),
        Segment(0, 0, 4, 0, (4 << 20) - 999, 0, 0, 0),
    ]
    check_against_reference(runner, [big], [dst], segments)


def test_pack_unpack_round_trip() -> None:
    rng = random.Random(11)
    tensors = tensor_zoo(rng, 1) + [random_tensor(rng, (0, 3), torch.float32), torch.tensor(2.5)]
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + t.numel() * t.element_size())
    flat = random_tensor(rng, (offsets[-1] + 13,), torch.uint8)
    tail = flat[offsets[-1] :].clone()
    assert kernels.pack(tensors, flat) == offsets
    assert torch.equal(flat[: offsets[-1]], torch.cat([as_bytes(t) for t in tensors]))
    assert torch.equal(flat[offsets[-1] :], tail)
    restored = [random_tensor(rng, tuple(t.shape), t.dtype) for t in tensors]
    assert kernels.unpack(flat, restored) == offsets
    assert same_bytes(restored, tensors)


def test_segment_copy_replays_and_reports_size() -> None:
    rng = random.Random(5)
    srcs, dsts = tensor_zoo(rng, 1), tensor_zoo(rng, 1)
    segments = random_segments(rng, srcs, dsts, 30, 4, 300)
    copier = kernels.make_segment_copy(srcs, dsts, segments)
    assert copier.num_segments == len(segments)
    assert copier.total_bytes == sum(s.num_rows * s.row_bytes for s in segments)
    for _ in range(2):
        for s in srcs:
            as_bytes(s).copy_(as_bytes(random_tensor(rng, tuple(s.shape), s.dtype)))
        expected = [d.clone() for d in dsts]
        kernels.copy_segments_reference(srcs, expected, segments)
        copier.run()
        assert same_bytes(dsts, expected)


def test_empty_table_is_a_no_op() -> None:
    dst = torch.ones(4)
    kernels.copy_segments([torch.zeros(4)], [dst], [])
    assert C.SegmentCopy([], [], kernels.segment_table([])).total_bytes == 0
    assert torch.equal(dst, torch.ones(4))


GOOD = Segment(0, 0, 16, 0, 0, 16, 2, 16)
BAD_SEGMENTS = [
    pytest.param(Segment(0, 40, 16, 0, 0, 16, 2, 16), "needs bytes", id="src-offset-out-of-bounds"),
    pytest.param(Segment(0, 0, 16, 0, 0, 40, 2, 16), "needs bytes", id="dst-stride-out-of-bounds"),
    pytest.param(Segment(0, 0, 16, 0, 0, 16, -1, 16), "negative", id="negative-rows"),
    pytest.param(Segment(0, 0, 16, 0, 0, 16, 1, -4), "negative", id="negative-row-bytes"),
    pytest.param(Segment(1, 0, 16, 0, 0, 16, 2, 16), "src_index out of range", id="src-index"),
    pytest.param(Segment(0, 0, 16, 2, 0, 16, 2, 16), "dst_index out of range", id="dst-index"),
    pytest.param(Segment(0, 0, 16, 0, 0, 8, 2, 16), "overlap", id="overlapping-dst-rows"),
    pytest.param(Segment(0, 0, 1 << 62, 0, 0, 16, 3, 16), "overflow", id="overflowing-stride"),
]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize(("bad", "message"), BAD_SEGMENTS)
def test_bad_segment_is_named_and_nothing_is_copied(runner: Runner, bad: Segment, message: str) -> None:
    src, dst = torch.arange(12, dtype=torch.float32), torch.zeros(12)
    with pytest.raises(RuntimeError, match=f"segment 1 .*{message}"):
        runner([src], [dst], kernels.segment_table([GOOD, bad]))
    assert torch.equal(dst, torch.zeros(12))


def test_reference_rejects_out_of_bounds_segments() -> None:
    with pytest.raises(ValueError, match="segment 0"):
        kernels.copy_segments_reference(
            [torch.zeros(4)], [torch.zeros(4)], [Segment(0, 4, 0, 0, 0, 0, 1, 16)]
        )


def test_reference_refuses_non_contiguous_tensors_as_the_kernel_does() -> None:
    """A reshape of a non-contiguous destination is a copy: the reference wrote into it, and a test comparing the
    kernel against an untouched destination passed."""
    dst = torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match="contiguous"):
        kernels.copy_segments_reference([torch.ones(16)], [dst], [Segment(0, 0, 16, 0, 0, 16, 1, 16)])


BAD_TABLES = [
    pytest.param(torch.zeros(1, 8), "int64", id="float-table"),
    pytest.param(torch.zeros(1, 7, dtype=torch.int64), r"shape \[n, 8\]", id="seven-columns"),
    pytest.param(torch.zeros(8, dtype=torch.int64), r"shape \[n, 8\]", id="one-dimensional"),
]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize(("table", "message"), BAD_TABLES)
def test_bad_table_is_rejected(runner: Runner, table: torch.Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        runner([torch.zeros(4)], [torch.zeros(4)], table)


@pytest.mark.parametrize("runner", RUNNERS)
def test_non_contiguous_and_mixed_device_tensors_are_rejected(runner: Runner) -> None:
    table = kernels.segment_table([GOOD])
    with pytest.raises(RuntimeError, match=r"srcs\[0\] is not contiguous"):
        runner([torch.zeros(4, 8).t()], [torch.zeros(32)], table)
    with pytest.raises(RuntimeError, match=r"one device.*dsts\[0\] is on meta"):
        runner([torch.zeros(32)], [torch.zeros(32, device="meta")], table)
    with pytest.raises(RuntimeError, match="not supported"):
        runner([torch.zeros(32, device="meta")], [torch.zeros(32, device="meta")], table)


def test_missing_extension_message_says_how_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(kernels.importlib, "import_module", missing)
    with pytest.raises(ImportError, match="pip install --no-build-isolation -e ."):
        kernels.extension()


@pytest.mark.gpu
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("align", [1, 2, 4, 8, 16])
def test_cuda_matches_reference(runner: Runner, align: int) -> None:
    assert C.with_cuda(), "megarl._C was built without CUDA on a machine with a GPU; rebuild it"
    rng = random.Random(100 + align)
    srcs, dsts = tensor_zoo(rng, 64), tensor_zoo(rng, 128)
    segments = random_segments(rng, srcs, dsts, 400, align, 4000)
    check_against_reference(runner, srcs, dsts, segments, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("runner", RUNNERS)
def test_cuda_large_and_tiny_segments_together(runner: Runner) -> None:
    rng = random.Random(9)
    big = random_tensor(rng, (6 << 20,), torch.uint8)
    dst = torch.zeros(16 << 20, dtype=torch.uint8)
    segments = [
        Segment(0, 16, 0, 0, 32, 0, 1, 5 << 20),
        Segment(0, 3, 0, 0, (5 << 20) + 37, 0, 1, (1 << 20) - 5),
        Segment(0, 64, 4096, 0, 7 << 20, 3072, 1000, 3056),
        Segment(0, 6, 130, 0, 11 << 20, 70, 5000, 66),
    ]
    segments += [Segment(0, 17 * i, 0, 0, (13 << 20) + 40 * i, 0, 1, 1 + i % 39) for i in range(2000)]
    check_against_reference(runner, [big], [dst], segments, device="cuda")


@pytest.mark.gpu
def test_cuda_run_is_a_pure_launch_on_the_current_stream() -> None:
    rng = random.Random(4)
    src = random_tensor(rng, (1 << 20,), torch.uint8).cuda()
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    segments = [Segment(0, 1, 2048, 0, 0, 1024, 500, 1000)]
    copier = kernels.make_segment_copy([src], [dst], segments)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copier.run()
    for _ in range(2):
        src.copy_(random_tensor(rng, (1 << 20,), torch.uint8).cuda())
        expected = dst.cpu()
        kernels.copy_segments_reference([src.cpu()], [expected], segments)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), expected)


@pytest.mark.gpu
def test_cuda_rejects_mixed_devices_and_cpu_table_only() -> None:
    table = kernels.segment_table([GOOD])
    with pytest.raises(RuntimeError, match="one device"):
        C.copy_segments([torch.zeros(32, device="cuda")], [torch.zeros(32)], table)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        C.copy_segments([torch.zeros(32, device="cuda")], [torch.zeros(32, device="cuda")], table.cuda())


OVERLAPPING = [
    pytest.param([Segment(0, 0, 0, 0, 0, 0, 1, 16), Segment(0, 20, 0, 0, 15, 0, 1, 4)], id="one-shared-byte"),
    pytest.param([Segment(0, 0, 8, 0, 0, 10, 8, 4), Segment(0, 0, 8, 0, 23, 10, 3, 4)], id="same-stride-rows"),
    pytest.param([Segment(0, 0, 8, 0, 0, 10, 8, 4), Segment(0, 0, 8, 0, 71, 7, 3, 2)], id="other-strides"),
    pytest.param([Segment(0, 0, 0, 0, 70, 0, 1, 2), Segment(0, 0, 0, 1, 0, 0, 1, 16)], id="two-views-of-one-storage"),
]


def overlap_case(device: str = "cpu") -> tuple[Tensors, Tensors]:
    dst = torch.zeros(256, dtype=torch.uint8, device=device)
    return [torch.arange(256, dtype=torch.uint8, device=device)], [dst, dst[64:128]]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("segments", OVERLAPPING)
def test_segments_writing_the_same_bytes_are_refused(runner: Runner, segments: list[Segment]) -> None:
    """Rows are written in parallel (on the GPU they race), so a byte two segments write is refused, by name."""
    srcs, dsts = overlap_case()
    with pytest.raises(RuntimeError, match=r"segment 0 .* and segment 1 .*write the same bytes of dsts\[0\]"):
        runner(srcs, dsts, kernels.segment_table(segments))
    with pytest.raises(RuntimeError, match="`model.embed_tokens.weight`"):
        kernels.make_segment_copy(srcs, dsts, segments, dst_names=["model.embed_tokens.weight", "landing"])
    assert not dsts[0].any()


READ_WHILE_WRITTEN = [
    pytest.param([Segment(0, 0, 0, 0, 8, 0, 1, 16)], "it writes itself", id="a-shifted-copy-within-one-buffer"),
    pytest.param([Segment(0, 0, 0, 0, 64, 0, 1, 8), Segment(0, 60, 0, 0, 200, 0, 1, 8)], "segment 0 .* writes",
                 id="a-read-of-another-segments-writes"),
    pytest.param([Segment(0, 32, 0, 0, 100, 4, 4, 4), Segment(0, 0, 0, 0, 30, 0, 1, 4)], "segment 1 .* writes",
                 id="a-row-read-again-stride-0"),
    pytest.param([Segment(0, 0, 16, 0, 128, 16, 4, 8), Segment(0, 0, 0, 0, 36, 0, 1, 2)], "segment 1 .* writes",
                 id="strided-rows-read-by-strided-writes"),
]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize(("segments", "writer"), READ_WHILE_WRITTEN)
def test_a_segment_reading_bytes_a_segment_writes_is_refused(runner: Runner, segments: list[Segment],
                                                             writer: str) -> None:
    """Rows are copied in parallel, so a byte one segment reads while another (or itself) writes it could be read
    before or after it changes: refused, naming both, before any byte moves."""
    buffer = torch.arange(256, dtype=torch.uint8)
    before = buffer.clone()
    with pytest.raises(RuntimeError, match=rf"segment \d .* reads bytes of srcs\[0\] \(`staging`\) that {writer}"):
        kernels.make_segment_copy([buffer], [buffer], segments, src_names=["staging"], dst_names=["staging"])
    with pytest.raises(RuntimeError, match="reads bytes of srcs"):
        runner([buffer], [buffer], kernels.segment_table(segments))
    assert torch.equal(buffer, before)


def test_reads_beside_writes_in_one_buffer_and_a_copy_onto_itself_are_accepted() -> None:
    """Interleaved rows of one buffer, read and written without sharing a byte, and a segment that copies bytes onto
    themselves (source and destination the same tensor), which changes nothing."""
    buffer = torch.arange(64, dtype=torch.uint8)
    expect = buffer.clone()
    expect.view(8, 8)[:, 4:] = expect.view(8, 8)[:, :4]
    kernels.make_segment_copy([buffer], [buffer], [Segment(0, 0, 8, 0, 4, 8, 8, 4),
                                                   Segment(0, 0, 0, 0, 0, 0, 1, 0)]).run()
    assert torch.equal(buffer, expect)
    kernels.make_segment_copy([buffer], [buffer], [Segment(0, 8, 16, 0, 8, 16, 3, 4)]).run()
    assert torch.equal(buffer, expect)


def test_interleaved_column_slices_are_accepted() -> None:
    """Two sources' column slices of one matrix (a row-parallel weight gathered from TP ranks): their extents
    overlap, their bytes do not."""
    left, right = torch.arange(64, dtype=torch.uint8), torch.arange(64, 128, dtype=torch.uint8)
    dst = torch.zeros(16, 8, dtype=torch.uint8)
    kernels.make_segment_copy([left, right], [dst], [Segment(0, 0, 4, 0, 0, 8, 16, 4),
                                                     Segment(1, 0, 4, 0, 4, 8, 16, 4)]).run()
    assert torch.equal(dst, torch.cat([left.view(16, 4), right.view(16, 4)], dim=1))


def offloaded(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(0)  # what megarl.memory.offload does to a tensor it moved off the device
    return t


def test_a_storage_freed_after_the_copy_was_built_is_refused_at_run() -> None:
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    copier = kernels.make_segment_copy([src], [dst], [Segment(0, 0, 0, 0, 0, 0, 1, 64)],
                                       src_names=["decoder.layers.0.mlp.linear_fc1.weight"],
                                       dst_names=["model.layers.0.mlp.gate_up_proj.weight"])
    copier.run()
    offloaded(dst)
    with pytest.raises(RuntimeError, match=r"dsts\[0\] \(`model.layers.0.mlp.gate_up_proj.weight`\) no longer has "
                                           "the memory the copy was built on"):
        copier.run()
    dst.untyped_storage().resize_(64)  # back, in other memory: still not what the plan writes to
    src.data = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"srcs\[0\] \(`decoder.layers.0.mlp.linear_fc1.weight`\) no longer"):
        copier.run()


@pytest.mark.parametrize("runner", RUNNERS)
def test_an_offloaded_tensor_is_refused_by_name(runner: Runner) -> None:
    table = kernels.segment_table([Segment(0, 0, 0, 0, 0, 0, 1, 64)])
    with pytest.raises(RuntimeError, match=r"dsts\[0\] has no memory behind it"):
        runner([torch.zeros(64, dtype=torch.uint8)], [offloaded(torch.zeros(64, dtype=torch.uint8))], table)
    with pytest.raises(RuntimeError, match=r"srcs\[0\] \(`lm_head.weight`\) has no memory behind it"):
        kernels.copy_segments([offloaded(torch.zeros(64, dtype=torch.uint8))], [torch.zeros(64, dtype=torch.uint8)],
                              table, src_names=["lm_head.weight"])


def test_names_must_match_the_tensors() -> None:
    with pytest.raises(RuntimeError, match="1 dsts names for 2 tensors"):
        kernels.make_segment_copy([], [torch.zeros(4), torch.zeros(4)], [], dst_names=["only-one"])


@pytest.mark.parametrize(("num_buffers", "buffer_bytes"), [(4, 2**62), (2, 2**63 - 1)])
def test_a_buffer_pool_whose_size_overflows_is_refused(num_buffers: int, buffer_bytes: int) -> None:
    """4 * 2^62 wrapped to 0: the pool allocated 256 bytes and handed out buffers far past them."""
    with pytest.raises(RuntimeError, match="overflow a 64-bit size"):
        C.BufferPool(num_buffers, buffer_bytes, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("segments", OVERLAPPING)
def test_cuda_refuses_segments_writing_the_same_bytes(runner: Runner, segments: list[Segment]) -> None:
    srcs, dsts = overlap_case("cuda")
    with pytest.raises(RuntimeError, match="write the same bytes"):
        runner(srcs, dsts, kernels.segment_table(segments))
    assert not dsts[0].any()


@pytest.mark.gpu
def test_cuda_refuses_freed_and_offloaded_storage() -> None:
    src = torch.arange(1 << 20, device="cuda").view(torch.uint8)
    dst = torch.zeros(1 << 23, dtype=torch.uint8, device="cuda")
    segments = [Segment(0, 0, 0, 0, 0, 0, 1, 1 << 23)]
    copier = kernels.make_segment_copy([src], [dst], segments, dst_names=["model.embed_tokens.weight"])
    copier.run()
    offloaded(dst)
    with pytest.raises(RuntimeError, match="`model.embed_tokens.weight`.* no longer has the memory"):
        copier.run()
    with pytest.raises(RuntimeError, match="`model.embed_tokens.weight`.* has no memory behind it"):
        kernels.make_segment_copy([src], [dst], segments, dst_names=["model.embed_tokens.weight"])
    with pytest.raises(RuntimeError, match="overflow a 64-bit size"):
        C.BufferPool(4, 2**62, "cuda")
    torch.cuda.synchronize()


def test_a_build_without_cuda_kernels_is_refused_on_a_gpu_before_the_first_step(monkeypatch):
    """A megarl._C built on a login node has the CPU kernels only: a GPU run must stop at start-up naming the
    rebuild, not at its first hand-over."""
    import types

    from megarl.errors import UserError
    from megarl.reshard import kernels

    monkeypatch.setattr(kernels, "extension", lambda: types.SimpleNamespace(with_cuda=lambda: False))
    with pytest.raises(UserError, match="built without its CUDA kernels.*MEGARL_FORCE_CUDA=1"):
        kernels.check_cuda_build()
    monkeypatch.setattr(kernels, "extension", lambda: types.SimpleNamespace(with_cuda=lambda: True))
    kernels.check_cuda_build()
