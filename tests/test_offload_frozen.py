"""Frozen weights leave the device without a copy once their host copy holds them: a later offload frees a storage
whose checksum equals the one its copy was taken at, copies a storage changed in place since, and every value
comes back bit for bit (megarl.memory.offload, run here on the CPU with keep_frozen on)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megarl.memory.offload import ModelResidency


class _Model:
    """What the offload reads of a MegatronModel: chunks, models (no DDP buffers), optimizer. A frozen linear
    layer (a LoRA actor's base, a reference model), a trained one and a module buffer."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        chunk = torch.nn.Module()
        chunk.frozen = torch.nn.Linear(64, 64, dtype=torch.bfloat16).requires_grad_(False)
        chunk.trained = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
        chunk.register_buffer("inv_freq", torch.rand(16))
        self.chunks = [chunk]
        self.models = self.chunks
        self.optimizer = None

    def values(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.chunks[0].state_dict().items()}


def frozen_bytes(model: _Model) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.chunks[0].frozen.parameters())


def round_trip(residency: ModelResidency) -> int:
    """Offload and onload the weights; the frozen bytes kept without a copy."""
    kept = residency.kept_bytes
    residency.offload(["weights"])
    assert all(p.untyped_storage().nbytes() == 0 for p in residency.model.chunks[0].parameters())
    residency.onload(["weights"])
    return residency.kept_bytes - kept


def test_unchanged_frozen_weights_are_freed_without_a_copy_and_come_back_whole():
    model = _Model()
    residency = ModelResidency(model, keep_frozen=True)
    expected = model.values()
    assert round_trip(residency) == 0  # the first time every storage is copied
    for step in range(3):
        with torch.no_grad():
            model.chunks[0].trained.weight.add_(1)  # the trained layer changes every step: always copied
            model.chunks[0].inv_freq.mul_(2)  # so may a module buffer
        expected = model.values()
        assert round_trip(residency) == frozen_bytes(model), step
        assert all(torch.equal(v, expected[k]) for k, v in model.values().items())


def test_a_frozen_weight_changed_in_place_is_copied_again():
    """A checkpoint loaded into frozen weights (here through .data, which no version counter sees) changes their
    checksum: the next offload copies them, and what comes back is the new value."""
    model = _Model()
    residency = ModelResidency(model, keep_frozen=True)
    round_trip(residency)
    model.chunks[0].frozen.weight.data[3, 5] += 1
    expected = model.values()
    kept = round_trip(residency)
    assert kept == model.chunks[0].frozen.bias.untyped_storage().nbytes()  # only the unchanged bias was kept
    assert all(torch.equal(v, expected[k]) for k, v in model.values().items())
    assert round_trip(residency) == frozen_bytes(model)  # unchanged again since: kept whole


def test_a_storage_a_trained_parameter_shares_is_always_copied():
    """A frozen parameter viewing the storage of a trained one (tied weights) may change with it."""
    model = _Model()
    model.chunks[0].tied = torch.nn.Parameter(model.chunks[0].trained.weight.detach()[:4], requires_grad=False)
    residency = ModelResidency(model, keep_frozen=True)
    round_trip(residency)
    with torch.no_grad():
        model.chunks[0].trained.weight.add_(1)
    expected = model.values()
    assert round_trip(residency) == frozen_bytes(model)  # the frozen layer only, not the shared storage
    assert all(torch.equal(v, expected[k]) for k, v in model.values().items())


def test_without_keep_frozen_every_offload_copies():
    model = _Model()
    residency = ModelResidency(model, keep_frozen=False)
    round_trip(residency)
    expected = model.values()
    assert round_trip(residency) == 0
    assert all(torch.equal(v, expected[k]) for k, v in model.values().items())


def test_the_gradients_leave_with_the_expert_parallel_buffers_too():
    """Megatron DDP keeps the experts' gradients under expert parallelism in expert_parallel_buffers (fp32, most of
    an MoE model's gradients): they stayed on the device through generation while the memory plan had them gone."""
    dense, expert = torch.ones(8), torch.full((1000,), 2.0)
    ddp = SimpleNamespace(buffers=[SimpleNamespace(param_data=None, grad_data=dense)],
                          expert_parallel_buffers=[SimpleNamespace(param_data=None, grad_data=expert)])
    residency = ModelResidency(SimpleNamespace(chunks=[], models=[ddp], optimizer=None), keep_frozen=False)
    residency.offload(["grads"])
    assert dense.untyped_storage().nbytes() == 0 and expert.untyped_storage().nbytes() == 0
    residency.onload(["grads"])  # every train step zeroes them first: they come back with their size, unkept
    assert expert.untyped_storage().nbytes() == 4000 and dense.untyped_storage().nbytes() == 32
