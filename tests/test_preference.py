"""Bradley-Terry loss and its per-response surrogate (megarl.algos.preference) against float64 references."""

import math

import pytest
import torch

from megarl.algos.preference import bradley_terry, surrogate_weights


def test_loss_and_statistics_match_a_float64_reference():
    gen = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(64, generator=gen) * 3, torch.randn(64, generator=gen) * 3
    rejected[0] = chosen[0]  # a tie counts half
    loss, stats = bradley_terry(chosen, rejected)
    pairs = list(zip(chosen.double().tolist(), rejected.double().tolist(), strict=True))
    ref = sum(math.log1p(math.exp(-(c - r))) for c, r in pairs) / len(pairs)
    assert abs(float(loss) - ref) < 1e-5
    right = sum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in pairs) / len(pairs)
    assert stats["accuracy"] == pytest.approx(right)
    assert stats["margin"] == pytest.approx(sum(c - r for c, r in pairs) / len(pairs), abs=1e-5)


def test_large_margins_stay_finite():
    loss, _ = bradley_terry(torch.tensor([200.0, -200.0]), torch.tensor([-200.0, 200.0]))
    assert math.isfinite(float(loss)) and float(loss) == pytest.approx(200.0, rel=1e-4)  # (0 + 400) / 2


def test_surrogate_gradient_equals_the_loss_gradient():
    """Training each response's score alone with the weights held fixed moves the model as the coupled loss does."""
    gen = torch.Generator().manual_seed(1)
    head = torch.randn(8, dtype=torch.float64, generator=gen, requires_grad=True)
    feats_c, feats_r = torch.randn(16, 8, dtype=torch.float64, generator=gen), torch.randn(16, 8, dtype=torch.float64,
                                                                                             generator=gen)
    loss, _ = bradley_terry(feats_c @ head, feats_r @ head)
    (exact,) = torch.autograd.grad(-torch.nn.functional.logsigmoid(feats_c @ head - feats_r @ head).mean(), head)
    w_c, w_r = surrogate_weights((feats_c @ head).detach(), (feats_r @ head).detach())
    weighted = (w_c.double() * (feats_c @ head)).sum() + (w_r.double() * (feats_r @ head)).sum()
    (surrogate,) = torch.autograd.grad(weighted / 16, head)
    assert torch.allclose(surrogate, exact, atol=1e-6), (surrogate, exact)
    reference = -torch.nn.functional.logsigmoid(feats_c @ head - feats_r @ head).mean()
    assert float(loss.detach()) == pytest.approx(float(reference.detach()), abs=1e-5)


@pytest.mark.parametrize("chosen, rejected", [(torch.zeros(3), torch.zeros(2)), (torch.zeros(0), torch.zeros(0)),
                                              (torch.zeros(2, 2), torch.zeros(2, 2))])
def test_mismatched_pairs_are_refused(chosen, rejected):
    with pytest.raises(ValueError, match="bradley_terry"):
        bradley_terry(chosen, rejected)
