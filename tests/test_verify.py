"""The hand-over checksum (megarl.reshard.verify, megarl._C's kernels) against a plain-integer reference, and what
it catches."""

import pytest
import torch

from megarl.errors import HandoverMismatch
from megarl.reshard.kernels import extension
from megarl.reshard.verify import MULTIPLIERS, PRIME, check_reports, tensor_checksum

INTEGER = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference(t: torch.Tensor, positions: list[int] | None = None) -> list[int]:
    """Python integers: sum of (bit pattern mod p) * ((i * a mod p) + 1), mod p, per multiplier a, i each
    element's position (its flat index unless given)."""
    bits = t.contiguous().view(-1).view(INTEGER[t.element_size()]).tolist()
    where = range(len(bits)) if positions is None else positions
    return [sum((b % PRIME) * ((i * a % PRIME) + 1) for i, b in zip(where, bits, strict=True)) % PRIME
            for a in MULTIPLIERS]


def torch_reference(t: torch.Tensor) -> list[int]:
    """The same sums in int64 torch ops, for tensors too large for Python integers."""
    bits = torch.remainder(t.contiguous().view(-1).view(INTEGER[t.element_size()]).to(torch.int64), PRIME)
    index = torch.arange(bits.numel(), dtype=torch.int64) % PRIME
    return [int(torch.remainder(bits * (index * a % PRIME + 1), PRIME).sum() % PRIME) for a in MULTIPLIERS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksum_equals_the_integer_reference(dtype):
    t = torch.randn(37, 29).to(dtype)
    assert tensor_checksum(t).tolist() == reference(t)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_a_strided_block_at_any_position_equals_the_reference(dtype):
    """Columns 5..16 of a [40, 23] tensor, each row's elements at positions 1000 + r * 300 + c: the part a
    column-sliced transfer adds to an engine tensor; the most negative and positive values included."""
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, (40, 23), dtype=dtype)
    t[0, 5], t[1, 6], t[2, 7] = info.min, info.max, -1
    got = extension().checksum(t, 5, 23, 40, 12, 1000, 300)
    positions = [1000 + r * 300 + c for r in range(40) for c in range(12)]
    assert got.tolist() == reference(t[:, 5:17], positions)


def test_a_large_tensor_split_over_threads_equals_the_reference():
    t = torch.randn(3 * 2**20 + 7)
    assert tensor_checksum(t).tolist() == torch_reference(t)


def test_blocks_past_the_tensor_are_refused():
    t = torch.zeros(10, 4)
    with pytest.raises(RuntimeError, match="run past the tensor"):
        extension().checksum(t, 2, 4, 10, 3, 0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_cuda_kernel_equals_the_cpu_one():
    torch.manual_seed(0)
    whole = torch.randn(50_000_017, dtype=torch.bfloat16)
    matrix = torch.randn(4096, 1000)
    assert tensor_checksum(whole.cuda()).tolist() == tensor_checksum(whole).tolist()
    block = (matrix, 300, 1000, 4096, 250, 77, 3000)
    assert extension().checksum(matrix.cuda(), *block[1:]).tolist() == extension().checksum(*block).tolist()


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
