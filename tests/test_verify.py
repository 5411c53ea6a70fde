"""The hand-over checksum (megarl.reshard.verify, megarl._C's kernels) against a plain-integer reference, and what
it catches."""

import pytest
import torch

from megarl.errors import HandoverMismatch
from megarl.reshard.kernels import extension
from megarl.reshard.verify import BASES, PRIMES, check_reports, tensor_checksum

UNSIGNED = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}


def halves(t: torch.Tensor) -> torch.Tensor:
    """The unsigned integers the checksum reads, one per element (8-byte elements: two, low half first)."""
    flat = t.contiguous().view(-1)
    if t.element_size() == 8:
        return flat.view(torch.uint32).to(torch.int64)
    return flat.view(UNSIGNED[t.element_size()]).to(torch.int64)


def reference(t: torch.Tensor, positions: list[int] | None = None) -> list[int]:
    """Python integers: sum of u * r^i mod p per prime p and base r, u each element's bits as an unsigned integer
    and i its position (its flat index unless given); an 8-byte element as two halves at 2i and 2i + 1."""
    u = halves(t).tolist()
    where = range(t.numel()) if positions is None else positions
    if t.element_size() == 8:
        where = [2 * i + h for i in where for h in (0, 1)]
    return [sum(b * pow(r, i, p) for i, b in zip(where, u, strict=True)) % p
            for p, r in zip(PRIMES, BASES, strict=True)]


def mulmod(a: torch.Tensor, b: torch.Tensor | int, p: int) -> torch.Tensor:
    """a * b mod p in int64 for a, b below 2^32, by b's two 16-bit halves (a product alone would overflow)."""
    high, low = b >> 16, b & 0xFFFF
    return ((a * high % p) * 65536 + a * low) % p


def torch_reference(t: torch.Tensor) -> list[int]:
    """The same sums in int64 torch ops, for tensors too large for Python integers: r^i by doubling."""
    u = halves(t)
    out = []
    for p, r in zip(PRIMES, BASES, strict=True):
        w = torch.ones(1, dtype=torch.int64)
        while w.numel() < u.numel():
            w = torch.cat([w, mulmod(w, pow(r, w.numel(), p), p)])
        out.append(int(mulmod(u % p, w[: u.numel()], p).sum() % p))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksum_equals_the_integer_reference(dtype):
    t = torch.randn(37, 29).to(dtype)
    assert tensor_checksum(t).tolist() == reference(t)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("first", [1000, 2**40 + 7])
def test_a_strided_block_at_any_position_equals_the_reference(dtype, first):
    """Columns 5..16 of a [40, 23] tensor, each row's elements at positions first + r * 300 + c: the part a
    column-sliced transfer adds to an engine tensor; the most negative and positive values included."""
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, (40, 23), dtype=dtype)
    t[0, 5], t[1, 6], t[2, 7] = info.min, info.max, -1
    got = extension().checksum(t, 5, 23, 40, 12, first, 300)
    positions = [first + r * 300 + c for r in range(40) for c in range(12)]
    assert got.tolist() == reference(t[:, 5:17], positions)


def test_a_large_tensor_split_over_threads_equals_the_reference():
    t = torch.randn(3 * 2**20 + 7)
    assert tensor_checksum(t).tolist() == torch_reference(t)


def test_blocks_past_the_tensor_are_refused():
    t = torch.zeros(10, 4)
    with pytest.raises(RuntimeError, match="run past the 40 elements"):
        extension().checksum(t, 2, 4, 10, 3, 0, 4)


def bits32(*patterns: int) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.int64).to(torch.uint32).view(torch.float32)


def bits64(*patterns: int) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.uint64).view(torch.float64)


@pytest.mark.parametrize(("a", "b"), [
    pytest.param(bits32(5, 0x7FFFFFFF, 9), bits32(5, 0, 9), id="0x7FFFFFFF-is-not-0"),
    pytest.param(bits32(0xFFFFFFFF), bits32(0x7FFFFFFE), id="float32-NaN-payloads"),
    pytest.param(bits64(0x7FF8000000000000 + 0x7FFFFFFF), bits64(0x7FF8000000000000), id="float64-NaN-payloads"),
    pytest.param(torch.tensor([2**31 - 1], dtype=torch.int64), torch.tensor([0], dtype=torch.int64), id="int64"),
])
def test_every_bit_pattern_counts(a, b):
    """Values were taken mod 2^31 - 1, which folded these pairs (two NaNs each, in the middle) onto each other."""
    assert tensor_checksum(a).tolist() != tensor_checksum(b).tolist()
    assert tensor_checksum(a).tolist() == reference(a)


@pytest.mark.parametrize("distance", [2**31 - 1, 2**31 - 2, PRIMES[0] - 1, PRIMES[1] - 1])
def test_a_swap_of_two_elements_any_distance_apart_is_seen(distance):
    """Two one-element rows whose positions are ``distance`` apart, the tensor never that large. Positions counted
    mod 2^31 - 1 gave a swap 2^31 - 1 apart the same checksum."""
    t, swapped = torch.tensor([7, -3], dtype=torch.int32), torch.tensor([-3, 7], dtype=torch.int32)
    assert extension().checksum(t, 0, 1, 2, 1, 0, distance).tolist() != \
        extension().checksum(swapped, 0, 1, 2, 1, 0, distance).tolist()


def test_mirrored_swaps_do_not_cancel():
    """Weights linear in the position cancel for [a, b, b, a] -> [b, a, a, b] (sums of v and of i * v agree)."""
    t = torch.tensor([11, -4, -4, 11], dtype=torch.int16)
    mirrored = t[[1, 0, 3, 2]]
    assert tensor_checksum(t.view(torch.bfloat16)).tolist() != tensor_checksum(mirrored.view(torch.bfloat16)).tolist()


@pytest.mark.parametrize(("offset", "row_stride", "num_rows"), [(0, 2**62, 5), (2**63 - 1, 1, 1)])
def test_bounds_that_wrap_int64_are_refused(offset, row_stride, num_rows):
    """4 * 2^62 and 2^63 - 1 + 1 wrapped, the block looked inside the 10 bytes, and the kernel read 2^62 bytes on
    (a segfault on CPU, an illegal address on CUDA)."""
    with pytest.raises(RuntimeError, match="run past the 10 elements"):
        extension().checksum(torch.zeros(10, dtype=torch.uint8), offset, row_stride, num_rows, 1, 0, 1)


def test_positions_past_int64_are_refused():
    with pytest.raises(RuntimeError, match="positions .* overflow"):
        extension().checksum(torch.zeros(4), 0, 1, 2, 1, 0, 2**62)


def offloaded(device: str = "cpu") -> torch.Tensor:
    t = torch.ones(1024, device=device)
    t.untyped_storage().resize_(0)  # what megarl.memory.offload does to a tensor it moved off the device
    return t


def test_an_offloaded_tensor_is_refused_by_name():
    with pytest.raises(RuntimeError, match="`model.norm.weight` has no memory behind it"):
        tensor_checksum(offloaded(), "model.norm.weight")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_cuda_kernel_equals_the_cpu_one():
    torch.manual_seed(0)
    whole = torch.randn(50_000_017, dtype=torch.bfloat16)
    matrix = torch.randn(4096, 1000)
    assert tensor_checksum(whole.cuda()).tolist() == tensor_checksum(whole).tolist()
    blocks = [(matrix, 300, 1000, 4096, 250, 77, 3000), (matrix, 3, 1000, 7, 997, 2**45 + 1, 2**33),
              (matrix.view(torch.int64), 0, 500, 4096, 500, 5, 500),
              (matrix.view(torch.uint8), 1, 4000, 99, 3999, 0, 5)]
    for block in blocks:
        assert extension().checksum(block[0].cuda(), *block[1:]).tolist() == extension().checksum(*block).tolist()
    small = torch.tensor([11, -4, -4, 11, 0x7FFF, -1, 3], dtype=torch.int16)
    assert tensor_checksum(small.cuda()).tolist() == reference(small)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_cuda_kernel_refuses_what_the_cpu_one_does():
    with pytest.raises(RuntimeError, match="`lm_head.weight` has no memory behind it"):
        tensor_checksum(offloaded("cuda"), "lm_head.weight")
    t = torch.zeros(10, device="cuda")
    with pytest.raises(RuntimeError, match="run past"):
        extension().checksum(t, 0, 2**62, 5, 1, 0, 1)  # 4 * 2^62 wrapped to 0: the bounds looked like 1 element
    with pytest.raises(RuntimeError, match="positions .* overflow"):
        extension().checksum(t, 0, 1, 2, 1, 0, 2**62)


def test_checksum_sees_values_and_places():
    t = torch.randn(64, 16, dtype=torch.bfloat16)
    base = tensor_checksum(t)
    swapped = t.clone()
    swapped[[3, 9]] = swapped[[9, 3]]
    transposed = t.view(16, 64).t().contiguous().view(64, 16)
    nudged = t.clone()
    nudged.view(-1).view(torch.int16)[100] += 1  # the lowest mantissa bit of one element
    for other in (swapped, transposed, nudged, torch.zeros_like(t)):
        assert not torch.equal(tensor_checksum(other), base)
    assert torch.equal(tensor_checksum(t.clone()), base)


def test_a_mismatch_names_each_gpu_and_its_tensors():
    check_reports(3, [[], []])
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(6)]
    with pytest.raises(HandoverMismatch) as err:
        check_reports(3, [[], names, ["lm_head.weight"]])
    text = str(err.value)
    assert "hand-over 3" in text and "GPU 0" not in text
    assert "GPU 1: model.layers.0.mlp.down_proj.weight" in text and "and 2 more" in text
    assert "GPU 2: lm_head.weight" in text and "verify_every: 0" in text
