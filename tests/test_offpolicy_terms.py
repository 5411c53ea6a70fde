"""The KL-to-reference and distillation-loss terms under staleness (async_rl): tokens drawn by an older policy
(behaviour b) estimate these terms under b unless weighted by pi_prox / b. Over a vocabulary small enough to
enumerate, in float64, the weighted estimators' expectation under b, and that of their gradient, are the on-policy
values computed exactly; the unweighted ones are off. In the sync loop nothing changes."""

from __future__ import annotations

import pytest
import torch

from megarl.algos.correction import rollout_correction
from megarl.algos.distill import reverse_kl_advantages
from megarl.algos.kl import kl_estimate
from megarl.config import AlgorithmConfig
from megarl.loop.rl_step import Batch, actor_loss, advantages_and_returns, offpolicy_weights

BEHAVIOUR = torch.tensor([8, 6, 3, 2, 1], dtype=torch.float64) / 20
"""b over a vocabulary of 5, in twentieths: a batch of 20 one-token samples holds each token as often as b draws
it in expectation, so a mean over that batch is the expectation under b, exactly."""
COUNTS = [8, 6, 3, 2, 1]
PROXIMAL_LOGITS = torch.tensor([0.1, 0.5, 0.2, -0.3, 0.4], dtype=torch.float64)
"""The policy being trained (pi = pi_prox at the step's first update): one version on from b."""
REFERENCE = torch.log_softmax(torch.tensor([0.3, -0.2, 0.6, 0.0, -0.5], dtype=torch.float64), 0)
ALGO = AlgorithmConfig(kl_coef=1.0, rollout_correction="token_tis", rollout_correction_cap=10.0)
"""A cap above every ratio p / b here (at most 4.9): the weights are the exact ratios."""


def stale_batch(current: bool = False) -> Batch:
    """The 20 one-token responses of prompt [0], all sampled by b (weights of the step before)."""
    responses = [[y] for y, count in enumerate(COUNTS) for _ in range(count)]
    batch = Batch.build([[0]] * 20, responses, [[0.0]] * 20, [0.0] * 20)
    batch.mask = batch.mask.double()
    batch.rollout_logprobs = BEHAVIOUR.log()[[y for y, in responses]][:, None]  # float64, as b is
    batch.current = torch.full_like(batch.mask, float(current))
    return batch


def weights_of(batch: Batch, old: torch.Tensor, algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``offpolicy_weights`` from the step's rollout correction, as train.py computes them once a step."""
    is_weights, kept, _ = rollout_correction(old, batch.rollout_logprobs, batch.mask, algo)
    return offpolicy_weights(batch, is_weights, kept)


def proximal_logprobs(batch: Batch, logits: torch.Tensor) -> torch.Tensor:
    """[20, 1] log pi(y) of each sample's token."""
    tokens = torch.tensor([s[1] for s in batch.sequences])
    return torch.log_softmax(logits, 0)[tokens][:, None]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_metric_under_staleness_is_the_proximal_policys_kl(estimator):
    """The ``kl`` metric (what adaptive_kl steers on): the weighted mean is E_p[k], computed over the vocabulary;
    the plain mean, E_b[k], is off."""
    algo = AlgorithmConfig(kl_coef=1.0, kl_estimator=estimator, kl_in_reward=estimator == "k1",
                           rollout_correction="token_tis", rollout_correction_cap=10.0)
    batch = stale_batch()
    old = proximal_logprobs(batch, PROXIMAL_LOGITS)
    ref = REFERENCE[[s[1] for s in batch.sequences]][:, None]
    _, _, metrics = advantages_and_returns(batch, algo, 20, 1.0, ref, old, None, 4,
                                           offpolicy=weights_of(batch, old, algo), loss_mask=batch.mask)
    logp = torch.log_softmax(PROXIMAL_LOGITS, 0)
    exact = float((logp.exp() * kl_estimate(logp, REFERENCE, estimator)).sum())
    behaviour = float((BEHAVIOUR * kl_estimate(logp, REFERENCE, estimator)).sum())
    assert metrics["kl"] == pytest.approx(exact, rel=1e-12)
    assert abs(behaviour - exact) > 0.1 * abs(exact)  # what the metric read before


def test_the_entropy_metric_under_staleness_is_the_proximal_policys():
    """-log pi_prox of tokens drawn by b averages to the cross-entropy H(b, p), not the policy's entropy; weighted,
    it is H(p)."""
    batch = stale_batch()
    old = proximal_logprobs(batch, PROXIMAL_LOGITS)
    _, _, metrics = advantages_and_returns(batch, ALGO, 20, 0.0, None, old, None, 4,
                                           offpolicy=weights_of(batch, old, ALGO), loss_mask=batch.mask)
    p = torch.softmax(PROXIMAL_LOGITS, 0)
    assert metrics["entropy"] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-12)
    assert abs(float(-(BEHAVIOUR * p.log()).sum()) - metrics["entropy"]) > 0.01


@pytest.mark.parametrize(("term", "estimator"), [("ref_logprobs", "k3"), ("ref_logprobs", "k2"),
                                                 ("teacher_logprobs", "k2")])
def test_the_kl_and_distillation_losses_gradient_under_staleness_is_the_on_policy_one(term, estimator):
    """The actor loss's KL term (algorithm.kl_estimator) and distill.form: loss's k2 term, over the batch sampled by
    b: with the off-policy weights, the loss and its gradient in the policy's logits are the on-policy ones,
    E_{y ~ p}[k(y)] and E_{y ~ p}[grad k(y)] summed over the vocabulary; without them, off by over 5%."""
    algo = AlgorithmConfig(kl_coef=1.0, kl_estimator=estimator, rollout_correction="token_tis",  # type: ignore[arg-type]
                           rollout_correction_cap=10.0)
    batch = stale_batch()
    tokens = [s[1] for s in batch.sequences]

    def loss_and_grad(weighted: bool) -> tuple[float, torch.Tensor]:
        logits = PROXIMAL_LOGITS.clone().requires_grad_()
        logp = proximal_logprobs(batch, logits)
        extras = {"old_logprobs": logp.detach(), "advantages": torch.zeros_like(logp),
                  "weights": batch.mask / batch.mask.sum(), term: REFERENCE[tokens][:, None]}
        if weighted:
            weights = weights_of(batch, logp.detach(), algo)
            assert weights is not None
            extras["offpolicy_weights"] = weights[0]
        loss, _ = actor_loss(logp, extras, algo, kl_coef=1.0, distill_coef=1.0)
        loss.backward()
        assert logits.grad is not None
        return float(loss.detach()), logits.grad

    logits = PROXIMAL_LOGITS.clone().requires_grad_()
    logp = torch.log_softmax(logits, 0)
    on_policy = (logp.exp().detach() * kl_estimate(logp, REFERENCE, "k2" if term == "teacher_logprobs"
                                                   else estimator)).sum()
    on_policy.backward()
    assert logits.grad is not None
    value, grad = loss_and_grad(weighted=True)
    assert value == pytest.approx(float(on_policy.detach()), rel=1e-12)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-12, atol=1e-15)
    _, plain = loss_and_grad(weighted=False)
    assert float((plain - logits.grad).norm() / logits.grad.norm()) > 0.05


def test_the_sync_loop_and_fresh_tokens_are_left_as_they_were():
    """No staleness: the sync loop's batch gets no weights (its terms bit for bit as before), and a batch whose
    behaviour logprobs are the proximal ones gets weights of exactly 1."""
    batch = stale_batch()
    batch.current = None
    assert weights_of(batch, batch.rollout_logprobs, ALGO) is None
    fresh = stale_batch(current=True)
    weights = weights_of(fresh, fresh.rollout_logprobs.clone(), ALGO)
    assert weights is not None and torch.equal(weights[0], fresh.mask) and torch.equal(weights[1], fresh.mask)


def test_the_weights_are_truncated_as_the_policys_correction():
    """A token the proximal policy favours past the cap is weighted at the cap (algorithm.rollout_correction_cap),
    as the policy loss weights it: the terms and the policy gradient see one distribution."""
    algo = AlgorithmConfig(kl_coef=1.0, rollout_correction="token_tis", rollout_correction_cap=2.0)
    batch = stale_batch()
    weights = weights_of(batch, proximal_logprobs(batch, PROXIMAL_LOGITS), algo)
    assert weights is not None
    ratio = torch.softmax(PROXIMAL_LOGITS, 0) / BEHAVIOUR
    expected = ratio.clamp(max=2.0)[[s[1] for s in batch.sequences]][:, None]
    torch.testing.assert_close(weights[0], expected, rtol=1e-12, atol=0)


def test_the_metrics_average_over_the_tokens_the_correction_keeps():
    """A masking correction (seq_*_mis) rejects sequences whose ratio leaves [1/cap, cap]: they are no sample of the
    proximal policy, so the kl and entropy metrics average over the kept tokens, as the loss does; counting the
    rejected ones in the denominator read both low."""
    algo = AlgorithmConfig(kl_coef=1.0, kl_estimator="k3", rollout_correction="seq_geomean_mis",
                           rollout_correction_cap=1.5)
    batch = stale_batch()
    old = proximal_logprobs(batch, PROXIMAL_LOGITS)
    ref = REFERENCE[[s[1] for s in batch.sequences]][:, None]
    ratio = (old - batch.rollout_logprobs).exp()[:, 0]
    kept = (ratio >= 1 / 1.5) & (ratio <= 1.5)
    assert 0 < int(kept.sum()) < 20  # the test needs both kinds
    _, _, metrics = advantages_and_returns(batch, algo, 20, 1.0, ref, old, None, 4,
                                           offpolicy=weights_of(batch, old, algo), loss_mask=batch.mask)
    k = kl_estimate(old, ref, "k3")[:, 0]
    assert metrics["kl"] == pytest.approx(float((ratio * k)[kept].sum() / kept.sum()), rel=1e-12)
    assert metrics["entropy"] == pytest.approx(float(-(ratio * old[:, 0])[kept].sum() / kept.sum()), rel=1e-12)


def test_the_distillation_metrics_under_staleness_are_the_proximal_policys():
    """distill/reverse_kl over tokens drawn by b: weighted, the student's KL(p || teacher) over the vocabulary; the
    plain mean, E_b[log p - log q], is off. distill/teacher_logprob likewise is E_p[log q]. Sync: as before."""
    batch = stale_batch()
    student = proximal_logprobs(batch, PROXIMAL_LOGITS)
    teacher = REFERENCE[[s[1] for s in batch.sequences]][:, None]
    _, metrics = reverse_kl_advantages(student, teacher, batch.mask, 1.0, weights_of(batch, student, ALGO))
    logp = torch.log_softmax(PROXIMAL_LOGITS, 0)
    assert metrics["distill/reverse_kl"] == pytest.approx(float((logp.exp() * (logp - REFERENCE)).sum()), rel=1e-12)
    assert metrics["distill/teacher_logprob"] == pytest.approx(float((logp.exp() * REFERENCE).sum()), rel=1e-12)
    _, plain = reverse_kl_advantages(student, teacher, batch.mask, 1.0)
    assert abs(plain["distill/reverse_kl"] - metrics["distill/reverse_kl"]) > 0.05 * metrics["distill/reverse_kl"]
