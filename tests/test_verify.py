"""The hand-over checksum (megarl.reshard.verify) against a plain-integer reference, and what it catches."""

import pytest
import torch

from megarl.errors import HandoverMismatch
from megarl.reshard.verify import CHUNK, MULTIPLIERS, PRIME, check_reports, tensor_checksum


def reference(t: torch.Tensor) -> list[int]:
    """Python integers: sum of (bit pattern mod p) * ((i * a mod p) + 1), mod p, per multiplier a."""
    integer = {2: torch.int16, 4: torch.int32}[t.element_size()]
    bits = t.contiguous().view(-1).view(integer).tolist()
    return [sum((b % PRIME) * ((i * a % PRIME) + 1) for i, b in enumerate(bits)) % PRIME for a in MULTIPLIERS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksum_equals_the_integer_reference(dtype):
    t = torch.randn(37, 29).to(dtype)
    assert tensor_checksum(t).tolist() == reference(t)


def test_checksum_across_chunks_equals_the_reference(monkeypatch):
    monkeypatch.setattr("megarl.reshard.verify.CHUNK", 100)  # many chunks, one partial
    t = torch.randn(1000)
    assert CHUNK > 100 and tensor_checksum(t).tolist() == reference(t)


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
