"""Advantages, PPO losses and KL against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos.advantages import gae, grpo_advantages, whiten
from megarl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_rewards,
    make_kl_controller,
)
from megarl.algos.losses import aggregate, entropy_bonus, policy_loss, value_loss
from megarl.config import AlgorithmConfig


def t(*rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def close(actual: torch.Tensor | float, expected: object, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def test_gae_by_hand() -> None:
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    rewards = t([0, 0, 1], [0, 1, 5], [0, 7, 1])
    values = t([0.5, 0.6, 0.7], [0.5, 0.6, 9.0], [0.5, 9.0, 0.7])
    mask = t([1, 1, 1], [1, 1, 0], [1, 0, 1])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    # Row 0, full mask; the value after the last token is 0.
    #   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3;      A2 = 0.3
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;   A1 = 0.03 + 0.72*0.3 = 0.246
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;   A0 = 0.04 + 0.72*0.246 = 0.21712
    # Row 1, padding at t=2 (its reward 5 and value 9 are ignored):
    #   t=1: delta = 1 + 0 - 0.6 = 0.4;          A1 = 0.4
    #   t=0: delta = 0.9*0.6 - 0.5 = 0.04;       A0 = 0.04 + 0.72*0.4 = 0.328
    # Row 2, a non-response token at t=1 is skipped: t=0 bootstraps from t=2.
    #   t=2: A2 = 1 - 0.7 = 0.3
    #   t=0: delta = 0.9*0.7 - 0.5 = 0.13;       A0 = 0.13 + 0.72*0.3 = 0.346
    close(adv, [[0.21712, 0.246, 0.3], [0.328, 0.4, 0], [0.346, 0, 0.3]])
    # returns = A + V on response tokens.
    close(ret, [[0.71712, 0.846, 1.0], [0.828, 1.0, 0], [0.846, 0, 1.0]])


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value() -> None:
    rewards = t([0.1, -0.2, 1.0, 0.0])
    values = t([0.3, 0.4, 0.5, 0.6])
    mask = t([1, 1, 1, 0])
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    # A_t = sum_{k >= t} r_k - V_t: 0.9 - 0.3, 0.8 - 0.4, 1.0 - 0.5
    close(adv, [[0.6, 0.4, 0.5, 0]])
    close(ret, [[0.9, 0.8, 1.0, 0]])


def test_grpo_advantages_by_hand() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # Group 1: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.577350
    #   -> +-0.5 / 0.577350 = +-0.866025. Group 2: all equal -> 0.
    s = 0.5 / math.sqrt(1 / 3)
    close(grpo_advantages(scores, 4), [s, -s, -s, s, 0, 0, 0, 0], atol=1e-5)
    # Dr. GRPO: subtract the mean only.
    close(grpo_advantages(scores, 4, std_normalize=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # Group [3, 0, 0]: mean 1, deviations [2, -1, -1], var = 6 / 2 = 3, std = 1.732051
    close(
        grpo_advantages(torch.tensor([3.0, 0.0, 0.0]), 3),
        [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)],
        atol=1e-5,
    )
    with pytest.raises(ValueError):
        grpo_advantages(scores, 3)


@pytest.mark.parametrize("std_normalize", [True, False])
def test_a_group_of_equal_scores_gets_exactly_zero_whatever_the_score(std_normalize: bool) -> None:
    """Scores such as 0.1 (the GSM8K format reward) are not exact in binary: a float32 group mean of eight of them
    is off by a rounding step, which the std normalisation turned into advantages of 1-10% for a group with no
    signal. Every equal group gets 0 in the scores' dtype; an unequal group keeps its float64 value."""
    for group in (4, 5, 8, 16):
        for k in range(41):
            score = k / 20
            scores = torch.full((2 * group,), score, dtype=torch.float32)
            scores[group:] = torch.arange(group, dtype=torch.float32) * 0.1 + score
            adv = grpo_advantages(scores, group, std_normalize=std_normalize)
            assert adv.dtype == torch.float32
            assert torch.equal(adv[:group], torch.zeros(group)), (group, score, adv[:group])
            ref = scores[group:].double() - scores[group:].double().mean()
            if std_normalize:
                ref = ref / (scores[group:].double().std() + 1e-6)
            torch.testing.assert_close(adv[group:], ref.float(), rtol=1e-6, atol=1e-6)


def test_whiten_by_hand() -> None:
    x = t([1, 2, 3], [4, 99, 99])
    mask = t([1, 1, 1], [1, 0, 0])
    # Tokens 1, 2, 3, 4: mean 2.5, var = (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25, std = 1.118034
    s = math.sqrt(1.25)
    close(whiten(x, mask), [[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0, 0]], atol=1e-6)


# Ratios and advantages for the PPO cases; clip_low 0.2 -> [0.8, ...], clip_high 0.28 -> [..., 1.28].
# The 7th token is masked out and must not count.
RATIOS = [1.1, 1.5, 0.5, 5.0, 0.5, 2.0, 100.0]
ADVANTAGES = [1.0, 1.0, -1.0, -2.0, 1.0, -1.0, 5.0]


def ppo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.full((1, 7), -1.0, dtype=torch.float64)
    logprobs = (old + torch.log(t(RATIOS))).requires_grad_()
    return logprobs, old, t(ADVANTAGES), t([1, 1, 1, 1, 1, 1, 0])


def test_policy_loss_by_hand() -> None:
    logprobs, old, adv, mask = ppo_inputs()
    # Per token: max(-A*r, -A*clip(r, 0.8, 1.28))
    #   r=1.1, A=+1: max(-1.1, -1.1)   = -1.1   inside the range
    #   r=1.5, A=+1: max(-1.5, -1.28)  = -1.28  clipped high
    #   r=0.5, A=-1: max(0.5, 0.8)     = 0.8    clipped low
    #   r=5.0, A=-2: max(10, 2.56)     = 10     (dual clip: min(10, 3*2) = 6)
    #   r=0.5, A=+1: max(-0.5, -0.8)   = -0.5   below the range but A > 0: not clipped
    #   r=2.0, A=-1: max(2, 1.28)      = 2      (dual clip: min(2, 3) = 2)
    loss, metrics = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, (-1.1 - 1.28 + 0.8 + 10 - 0.5 + 2) / 6)  # 1.653333
    close(metrics["clip_fraction"], 2 / 6)
    loss, metrics = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    close(loss, (-1.1 - 1.28 + 0.8 + 6 - 0.5 + 2) / 6)  # 0.986667
    close(metrics["clip_fraction"], 3 / 6)
    close(metrics["dual_clip_fraction"], 1 / 6)
    # approx_kl = mean of (r - 1) - log r: 0.0046898 + 0.0945349 + 0.1931472 + 2.3905621 + 0.1931472 + 0.3068528
    close(metrics["approx_kl"], 3.1829340 / 6, atol=1e-6)


def test_policy_loss_gradient_is_zero_on_clipped_tokens() -> None:
    logprobs, old, adv, mask = ppo_inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    loss.backward()
    assert logprobs.grad is not None
    # d(-A*r)/dlogp = -A*r on unclipped tokens, over 6 tokens; clipped, dual-clipped and masked: 0.
    close(logprobs.grad, [[-1.1 / 6, 0, 0, 0, -0.5 / 6, 2.0 / 6, 0]])


def test_policy_loss_huge_log_ratio_stays_finite() -> None:
    # exp(500) overflows float32; the log-ratio is clamped to [-20, 20] first.
    logprobs = torch.tensor([[0.0, -500.0]], requires_grad=True)
    old = torch.tensor([[-500.0, 0.0]])
    loss, metrics = policy_loss(logprobs, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), 0.2, 0.2)
    loss.backward()
    assert logprobs.grad is not None
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all() and torch.isfinite(metrics["approx_kl"])


def test_aggregation_modes_with_uneven_masks() -> None:
    loss = t([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9])
    mask = t([1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0])  # 3 tokens, 1 token, an empty sequence
    close(aggregate(loss, mask, "token-mean"), (1 + 2 + 3 + 5) / 4)  # 2.75
    close(aggregate(loss, mask, "seq-mean-token-sum"), (6 + 5) / 2)  # sums 6 and 5; empty row left out
    close(aggregate(loss, mask, "seq-mean-token-mean"), (2 + 5) / 2)  # means 2 and 5
    # Dr. GRPO: the sums over a constant (max_new_tokens 10), whatever the lengths: (6 / 10 + 5 / 10) / 2.
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", max_tokens=10), (0.6 + 0.5) / 2)
    with pytest.raises(ValueError, match="rollout.max_new_tokens"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")


def test_dr_grpo_normaliser_does_not_depend_on_response_lengths() -> None:
    """Each token of every sequence weighs 1 / (sequences x max_new_tokens): a sequence's weight per token does not
    shrink as it grows (as with seq-mean-token-mean) and does not change with the others' lengths (token-mean)."""
    from megarl.algos.losses import token_weights

    short, long = t([1, 0, 0, 0], [1, 1, 0, 0]), t([1, 1, 1, 1], [1, 1, 0, 0])
    for mask in (short, long):
        close(token_weights(mask, "seq-mean-token-sum-norm", max_tokens=8), mask / (2 * 8))
    assert token_weights(short, "token-mean")[1, 0] != token_weights(long, "token-mean")[1, 0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_aggregation_of_empty_mask_is_zero_with_a_gradient(mode: str) -> None:
    loss = t([1.0, 2.0]).requires_grad_()
    out = aggregate(loss, torch.zeros_like(loss), mode, max_tokens=4)  # type: ignore[arg-type]
    out.backward()
    assert out.item() == 0 and loss.grad is not None and loss.grad.abs().sum() == 0


def test_value_loss_by_hand() -> None:
    values = t([1.0, 0.5, 0.0, 2.0, 50.0])
    old = t([0.5, 0.5, 0.5, 1.9, 0.0])
    returns = t([1.0, 0.0, 1.0, 2.0, 0.0])
    mask = t([1, 1, 1, 1, 0])
    # Clipped values old + clip(V - old, -0.2, 0.2): 0.7, 0.5, 0.3, 2.0
    #   (V - R)^2: 0, 0.25, 1.0, 0;  (Vclip - R)^2: 0.09, 0.25, 0.49, 0;  max: 0.09, 0.25, 1.0, 0
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    close(loss, 0.5 * (0.09 + 0.25 + 1.0 + 0) / 4)  # 0.1675
    close(metrics["clip_fraction"], 1 / 4)
    loss, metrics = value_loss(values, old, returns, mask, clip=None)
    close(loss, 0.5 * (0 + 0.25 + 1.0 + 0) / 4)  # 0.15625
    close(metrics["clip_fraction"], 0)


def test_entropy_bonus_aggregates() -> None:
    entropy = t([1.0, 3.0, 100.0], [2.0, 0.0, 0.0])
    mask = t([1, 1, 0], [1, 0, 0])
    close(entropy_bonus(entropy, mask), 2.0)  # (1 + 3 + 2) / 3
    close(entropy_bonus(entropy, mask, "seq-mean-token-mean"), 2.0)  # (2 + 2) / 2


def test_kl_estimators_by_hand() -> None:
    logp = t([-1.0, -2.0])
    ref = t([-1.5, -1.0])
    # logp - ref = 0.5, -1.0
    close(kl_estimate(logp, ref, "k1"), [[0.5, -1.0]])
    close(kl_estimate(logp, ref, "k2"), [[0.125, 0.5]])  # 0.5 * 0.25, 0.5 * 1
    # d = ref - logp = -0.5, 1.0: exp(-0.5) + 0.5 - 1 = 0.1065307, e - 1 - 1 = 0.7182818
    close(kl_estimate(logp, ref, "k3"), [[0.1065307, 0.7182818]], atol=1e-6)
    # The estimate itself is bounded by 10 (as in verl and OpenRLHF): exp(20) - 21 ~ 5e8 would let one
    # token dominate an update. d = 3: e^3 - 4 = 16.09 -> 10; d = 2: e^2 - 3 = 4.389 stays.
    extreme = kl_estimate(t([0.0, -1000.0, 0.0, 0.0]).float(), t([-1000.0, 0.0, 3.0, 2.0]).float(), "k3")
    torch.testing.assert_close(extreme, torch.tensor([[10.0, 10.0, 10.0, math.exp(2) - 3]]))
    # A clamped token gets no gradient; one below the bound keeps exp(d) - 1 = e^2 - 1.
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    kl_estimate(logp, torch.tensor([[3.0, 2.0]]), "k3").sum().backward()
    assert logp.grad is not None
    close(logp.grad, [[0.0, -(math.exp(2) - 1)]], atol=1e-5)


def test_only_k1_in_the_reward_and_k2_in_the_loss_follow_the_kl_gradient() -> None:
    """Why AlgorithmConfig refuses k1 in the loss and picks k1 for the reward: over a 6-way policy, exact
    expectations in float64 against the gradient of KL(p || ref) in the logits. In the loss (pathwise), E_p[grad k1]
    is zero; in the reward (score function), E_p[k1 * grad log p] is the KL's gradient."""
    torch.manual_seed(0)
    logits = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, dtype=torch.float64), 0)
    logp = torch.log_softmax(logits, 0)
    p = logp.exp().detach()
    (true,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), logits, retain_graph=True)

    def in_loss(estimator: str) -> torch.Tensor:
        return torch.autograd.grad((p * kl_estimate(logp, ref, estimator)).sum(), logits, retain_graph=True)[0]

    def in_reward(estimator: str) -> torch.Tensor:
        reward = kl_estimate(logp, ref, estimator).detach()
        return torch.autograd.grad((p * reward * logp).sum(), logits, retain_graph=True)[0]

    assert true.abs().max() > 0.05
    torch.testing.assert_close(in_loss("k1"), torch.zeros_like(true), atol=1e-12, rtol=0)
    torch.testing.assert_close(in_loss("k2"), true, atol=1e-12, rtol=0)
    torch.testing.assert_close(in_reward("k1"), true, atol=1e-12, rtol=0)
    # k3 in the loss (GRPO's) follows the other direction, KL(reference || policy)
    (reverse,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), logits, retain_graph=True)
    torch.testing.assert_close(in_loss("k3"), reverse, atol=1e-12, rtol=0)


def test_kl_penalized_rewards_by_hand() -> None:
    scores = t(1.0, 0.5, 3.0)
    kl = t([0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [1.0, 1.0, 1.0])
    mask = t([1, 1, 0], [1, 1, 1], [0, 0, 0])
    # -0.1 * kl on response tokens; the score lands on the last response token; an empty row gets nothing.
    close(
        kl_penalized_rewards(scores, kl, mask, kl_coef=0.1),
        [[-0.01, -0.02 + 1.0, 0], [-0.04, -0.05, -0.06 + 0.5], [0, 0, 0]],
    )


def test_adaptive_kl_controller_by_hand() -> None:
    ctl = AdaptiveKLController(init_coef=0.1, target=0.05, horizon=1000)
    ctl.update(current_kl=0.06, n_steps=100)  # error 0.06/0.05 - 1 = 0.2; x(1 + 0.2*0.1) = 0.102
    close(ctl.value, 0.102)
    ctl.update(current_kl=0.5, n_steps=100)  # error 9 clipped to 0.2; 0.102 * 1.02 = 0.10404
    close(ctl.value, 0.10404)
    ctl.update(current_kl=0.04, n_steps=500)  # error -0.2; x(1 - 0.2*0.5) = 0.093636
    close(ctl.value, 0.093636)
    ctl.update(current_kl=0.045, n_steps=1000)  # error -0.1; x0.9 = 0.0842724
    close(ctl.value, 0.0842724)
    resumed = AdaptiveKLController(init_coef=0.1, target=0.05, horizon=1000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value


def test_kl_controller_from_config() -> None:
    fixed = make_kl_controller(AlgorithmConfig(kl_coef=0.05))
    assert isinstance(fixed, FixedKLController)
    fixed.update(current_kl=10.0, n_steps=100)
    assert fixed.value == 0.05
    adaptive = make_kl_controller(AlgorithmConfig(kl_coef=0.05, adaptive_kl=True, kl_target=0.1, kl_horizon=100))
    assert isinstance(adaptive, AdaptiveKLController)
    adaptive.update(current_kl=1.0, n_steps=100)
    close(adaptive.value, 0.05 * 1.2)


def test_token_weights_reproduce_every_aggregation_across_micro_batches():
    from megarl.algos.losses import aggregate, token_weights

    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 7, generator=gen)
    mask = (torch.rand(6, 7, generator=gen) > 0.3).float()
    mask[2] = 0  # an empty sequence
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        w = token_weights(mask, mode, max_tokens=16)
        # Split into micro-batches: the weighted parts add up to the global aggregate.
        parts = sum(aggregate(loss[i:i + 2], w[i:i + 2], "weighted") for i in range(0, 6, 2))
        assert torch.allclose(parts, aggregate(loss, mask, mode, max_tokens=16)), mode


def test_rollout_correction_weights_by_hand() -> None:
    from megarl.algos.correction import rollout_correction_weights

    # Sequence 0: token log-ratios old - rollout = ln 3, ln 0.5, 0 (mean ln(1.5)/3); sequence 1: ln 4 (one token).
    old = t([math.log(3), math.log(0.5), 0.0], [math.log(4), 0.0, 0.0])
    rollout = torch.zeros(2, 3, dtype=torch.float64)
    mask = t([1, 1, 1], [1, 0, 0])
    w, kept, m = rollout_correction_weights(old, rollout, mask, "token_tis", cap=2.0)
    close(w, [[2.0, 0.5, 1.0], [2.0, 0, 0]])  # 3 and 4 truncated at 2
    close(kept, mask)
    assert m["truncated_fraction"] == 0.5 and m["weight_max"] == 2.0 and m["weight_min"] == 0.5
    close(m["token_ratio_max"], 4.0)
    close(m["weight_mean"], (2 + 0.5 + 1 + 2) / 4)
    # Geometric means: (3 * 0.5 * 1)^(1/3) = 1.1447142, and 4 for sequence 1.
    g = 1.5 ** (1 / 3)
    w, kept, m = rollout_correction_weights(old, rollout, mask, "seq_geomean_tis", cap=2.0)
    close(w, [[g, g, g], [2.0, 0, 0]])
    close(kept, mask)
    assert m["truncated_fraction"] == 0.25 and m["rejected_fraction"] == 0
    # The sequence's importance ratio, the product of its token ratios: 3 * 0.5 * 1 = 1.5, and 4.
    w, kept, m = rollout_correction_weights(old, rollout, mask, "seq_product_tis", cap=1.25)
    close(w, [[1.25, 1.25, 1.25], [1.25, 0, 0]])
    w, kept, m = rollout_correction_weights(old, rollout, mask, "seq_product_tis", cap=2.0)
    close(w, [[1.5, 1.5, 1.5], [2.0, 0, 0]])
    # Masked IS rejects sequence 1 (4 > cap) and keeps sequence 0 at its ratio; sequence 1 leaves the loss.
    for mode, ratio in (("seq_geomean_mis", g), ("seq_product_mis", 1.5)):
        w, kept, m = rollout_correction_weights(old, rollout, mask, mode, cap=2.0)  # type: ignore[arg-type]
        close(w, [[ratio] * 3, [0, 0, 0]])
        close(kept, [[1, 1, 1], [0, 0, 0]])
        assert m["rejected_fraction"] == 0.25, mode
        # ... and also a sequence below 1 / cap.
        w, kept, _ = rollout_correction_weights(-old, rollout, mask, mode, cap=2.0)  # type: ignore[arg-type]
        close(w, [[1 / ratio] * 3, [0, 0, 0]])
        close(kept, [[1, 1, 1], [0, 0, 0]])
    w, kept, m = rollout_correction_weights(old, rollout, mask, "none", cap=2.0)
    close(w, mask)
    assert m["truncated_fraction"] == 0 and m["token_ratio_max"] == pytest.approx(4.0)


def test_sequence_product_ratio_acts_where_the_geometric_mean_does_not() -> None:
    """500 tokens whose log-ratios have noise 0.05 (the issue's case): the geometric mean stays within 1 +- 2%, so
    a cap of 2 never acts; the product, the sequence's actual importance ratio, spreads over e^+-1 and its cap
    truncates or rejects."""
    from megarl.algos.correction import rollout_correction_weights

    gen = torch.Generator().manual_seed(0)
    old = 0.05 * torch.randn(64, 500, generator=gen, dtype=torch.float64)
    rollout, mask = torch.zeros_like(old), torch.ones_like(old)
    geo, _, m = rollout_correction_weights(old, rollout, mask, "seq_geomean_tis", cap=2.0)
    assert 0.98 < m["weight_min"] and m["weight_max"] < 1.02 and m["truncated_fraction"] == 0
    product, _, m = rollout_correction_weights(old, rollout, mask, "seq_product_tis", cap=2.0)
    close(product[:, 0], old.sum(dim=1).exp().clamp(max=2.0))
    assert m["weight_min"] < 0.5 and 0 < m["truncated_fraction"] < 0.5
    _, kept, m = rollout_correction_weights(old, rollout, mask, "seq_product_mis", cap=2.0)
    assert 0.2 < m["rejected_fraction"] < 0.8 and kept.sum() == (1 - m["rejected_fraction"]) * mask.sum()


def test_retired_correction_names_say_what_replaced_them() -> None:
    from megarl.config import build_config
    from megarl.errors import UserError

    for retired, now in (("seq_tis", "seq_geomean_tis"), ("seq_mis", "seq_geomean_mis")):
        with pytest.raises(UserError, match=rf"`algorithm.rollout_correction` \(--set .*\) = \"{retired}\" is no "
                                            rf"longer a choice. Fix: use `{now}` for the same .*`seq_product_"):
            build_config({"model": {"hf_path": "m"}, "data": {"train_path": "d"}}, [
                f"algorithm.rollout_correction={retired}"])


def test_policy_loss_is_weighted_per_token() -> None:
    logprobs = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv, mask = t([1.0, -2.0]), t([1, 1])
    # Ratio 1 everywhere: per-token loss -A = [-1, 2]; weights [0.5, 2] -> mean of [-0.5, 4] = 1.75.
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2, 0.2, is_weights=t([0.5, 2.0]))
    close(loss, 1.75)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[-0.25, 2.0]])  # d(-A r w)/d logp / 2 tokens


def test_overlong_penalty_by_hand() -> None:
    from megarl.algos.shaping import overlong_penalty

    # Limit 100, buffer 20: free up to 80, then linear to -penalty at 100.
    lengths = torch.tensor([10, 80, 90, 100])
    close(overlong_penalty(lengths, 100, 20, 1.0), [0, 0, -0.5, -1.0])
    close(overlong_penalty(lengths, 100, 20, 0.5), [0, 0, -0.25, -0.5])
    close(overlong_penalty(lengths, 100, 0, 1.0), [0, 0, 0, 0])


def test_informative_groups() -> None:
    from megarl.algos.shaping import informative_groups

    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.6])
    assert informative_groups(scores, 3).tolist() == [False, True, False, True]


def test_the_decoupled_ppo_loss_of_stale_samples_by_hand() -> None:
    """async_rl: a sample's tokens come from older weights (the behaviour policy, the engine's logprobs), the
    trainer's old-logprob pass gives the proximal policy, and the update's ratio is to the proximal one. The loss
    (Hilton et al. 2021; AReaL) per token is min(pi_prox / pi_behav, cap) x max(-A r, -A clip(r)), r = pi /
    pi_prox: rollout_correction token_tis feeding policy_loss, token-mean over the response."""
    from megarl.algos.correction import rollout_correction

    behaviour = torch.tensor([[-1.2, -0.4, -2.0], [-0.3, -0.9, 0.0]], dtype=torch.float64)
    proximal = torch.tensor([[-0.5, -0.6, -2.1], [-0.35, -0.2, 0.0]], dtype=torch.float64)
    new = torch.tensor([[-0.3, -0.7, -1.5], [-0.4, -0.25, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    algo = AlgorithmConfig(rollout_correction="token_tis", rollout_correction_cap=1.5)
    weights, kept, _ = rollout_correction(proximal, behaviour, mask, algo)
    loss, _ = policy_loss(new, proximal, adv, kept, clip_low=0.2, clip_high=0.28, is_weights=weights)
    total = 0.0
    for i, j in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        w = min(math.exp(proximal[i, j] - behaviour[i, j]), 1.5)
        r = math.exp(new[i, j] - proximal[i, j])
        a = float(adv[i, j])
        total += w * max(-a * r, -a * min(max(r, 0.8), 1.28))
    assert math.isclose(float(loss), total / 5, rel_tol=1e-12)
    # Token (0, 0): the engine's weights put it at e^-1.2, the proximal at e^-0.5: w is capped at 1.5, not 2.01.
    assert float(weights[0, 0]) == 1.5
