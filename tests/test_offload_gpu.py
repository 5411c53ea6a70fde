"""Overlapped offload on a GPU: two models trade places (one to host memory, the other back) with both copy
directions running at once; every value survives, and the device never holds more than the slack beyond
what it held before."""

from __future__ import annotations

import pytest
import torch

from megarl.memory.offload import Residency

pytestmark = pytest.mark.gpu


class _Model:
    """What megarl.memory.offload reads of a MegatronModel: chunks, models (no DDP buffers), optimizer."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.chunks = [torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, device="cuda") for _ in range(8)])]
        self.models = self.chunks
        self.optimizer = torch.optim.Adam(self.chunks[0].parameters())
        self.chunks[0](torch.randn(4, 2048, device="cuda")).sum().backward()
        self.optimizer.step()  # Adam's moments exist from here on
        self.optimizer.zero_grad(set_to_none=True)

    def values(self) -> list[torch.Tensor]:
        params = list(self.chunks[0].parameters())
        state = [v for p in params for v in self.optimizer.state[p].values() if v.dim() > 0]
        return [t.detach().cpu().clone() for t in params + state]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_models_trade_places_with_values_kept_and_the_peak_bounded():
    a, b = _Model(0), _Model(1)
    expected = {"a": a.values(), "b": b.values()}
    slack = 64 * 2**20
    residency = Residency({"a": a, "b": b}, {"a": {"weights", "optimizer"}, "b": {"weights", "optimizer"}},
                          slack_bytes=slack)
    both = {"weights", "optimizer"}
    residency.hold({"a": both})
    assert residency.states["b"].device_bytes("weights") == 0 and residency.states["b"].device_bytes("optimizer") == 0
    for name, model, other in (("b", b, "a"), ("a", a, "b"), ("b", b, "a")):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        residency.hold({name: both})
        assert torch.cuda.max_memory_allocated() <= before + slack + 16 * 2**20  # allocator rounding
        assert residency.states[other].device_bytes("weights") == 0
        for got, want in zip(model.values(), expected[name], strict=True):
            assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_frozen_weights_trade_places_without_a_copy_once_copied():
    """A frozen model (a reference) beside a trained one: from its second trip out its unchanged weights are freed
    without a copy (keep_frozen is on by default on a GPU), one changed in place is copied, and both come back
    bit for bit through the overlapped streams."""
    a, b = _Model(0), _Model(1)
    b.chunks[0].requires_grad_(False)
    b.optimizer = None
    residency = Residency({"a": a, "b": b}, {"a": {"weights", "optimizer"}, "b": {"weights"}})
    weights = sum(p.numel() * p.element_size() for p in b.chunks[0].parameters())
    for trip in range(3):
        if trip == 2:
            with torch.no_grad():
                b.chunks[0][0].weight.data.add_(1)
        want = [p.detach().cpu().clone() for p in b.chunks[0].parameters()]
        kept = residency.states["b"].kept_bytes
        residency.hold({"a": {"weights", "optimizer"}})
        residency.hold({"b": {"weights"}})
        changed = b.chunks[0][0].weight
        expect = {0: 0, 1: weights, 2: weights - changed.numel() * changed.element_size()}[trip]
        assert residency.states["b"].kept_bytes - kept == expect
        assert all(torch.equal(p.detach().cpu(), w) for p, w in zip(b.chunks[0].parameters(), want, strict=True))
