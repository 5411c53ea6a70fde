"""The per-step RL plumbing between rollout and update (megarl.loop.rl_step), against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos.correction import rollout_correction
from megarl.algos.losses import token_weights
from megarl.config import AlgorithmConfig, RolloutConfig
from megarl.errors import TrainingDiverged, UserError
from megarl.loop.rl_step import (
    Batch,
    actor_loss,
    actor_loss_mask,
    advantages_and_returns,
    check_drift,
    critic_loss,
    critic_loss_mask,
    logprob_drift,
)


def batch_of(scores: list[float], response_lens: list[int]) -> Batch:
    prompts = [[1, 2]] * len(scores)
    responses = [[3] * n for n in response_lens]
    return Batch.build(prompts, responses, [[-1.0] * n for n in response_lens], scores)


def test_grpo_kl_in_reward_is_subtracted_from_scores_before_group_normalisation() -> None:
    batch = batch_of([1.0, 1.0], [2, 1])
    algo = AlgorithmConfig(name="grpo", kl_coef=0.5, kl_in_reward=True, kl_estimator="k1")
    old = batch.rollout_logprobs.clone()
    ref = old - batch.mask * torch.tensor([[0.0, 0.4, 0.6], [0.0, 0.2, 0.0]])  # k1 = 0.4 + 0.6 and 0.2
    adv, _, metrics = advantages_and_returns(batch, algo, 2, 0.5, ref, old, None, max_new_tokens=8, offpolicy=None,
                                             loss_mask=batch.mask)
    # Scores 1 - 0.5 * 1.0 = 0.5 and 1 - 0.5 * 0.2 = 0.9: centred -0.2, +0.2; unbiased std 0.2828.
    expected = 0.2 / math.sqrt(0.08)
    torch.testing.assert_close(adv[:, 1], torch.tensor([-expected, expected]), atol=1e-4, rtol=0)
    assert metrics["kl"] == pytest.approx(1.2 / 3)
    # Without the KL in the reward the equal scores carry no signal.
    algo = AlgorithmConfig(name="grpo", kl_coef=0.5, kl_estimator="k3")
    adv, _, _ = advantages_and_returns(batch, algo, 2, 0.5, ref, old, None, max_new_tokens=8, offpolicy=None,
                                       loss_mask=batch.mask)
    assert adv.abs().max() == 0


def test_ppo_kl_in_reward_uses_the_configured_estimator() -> None:
    batch = batch_of([0.0], [1])
    old = batch.rollout_logprobs.clone()
    ref = old + batch.mask * 3.0  # d = ref - logp = 3: k1 = -3, k3 = min(e^3 - 4, 10) = 10
    values = torch.zeros_like(batch.mask)
    for estimator, kl in (("k1", -3.0), ("k2", 4.5), ("k3", 10.0)):
        algo = AlgorithmConfig(name="ppo", kl_coef=0.1, kl_in_reward=True, kl_estimator=estimator)
        _, returns, metrics = advantages_and_returns(batch, algo, 1, 0.1, ref, old, values, max_new_tokens=8,
                                                    offpolicy=None, loss_mask=batch.mask)
        assert returns is not None
        assert metrics["kl"] == pytest.approx(kl)
        assert returns[0, 1].item() == pytest.approx(-0.1 * kl)  # the one token's reward, gamma = lambda = 1


def test_overlong_penalty_shapes_grpo_advantages() -> None:
    batch = batch_of([1.0, 1.0], [8, 4])  # limit 8, buffer 4: the first response loses the full penalty
    algo = AlgorithmConfig(name="grpo", overlong_buffer_tokens=4, overlong_penalty=1.0)
    adv, _, metrics = advantages_and_returns(batch, algo, 2, 0.0, None, batch.rollout_logprobs, None, max_new_tokens=8,
                                          offpolicy=None, loss_mask=batch.mask)
    assert metrics["overlong_penalty"] == pytest.approx(-0.5)
    assert adv[0, 1] < 0 < adv[1, 1]


def test_drift_check_fails_on_nan_at_any_step() -> None:
    batch = batch_of([1.0, 0.0], [2, 2])
    trainer = batch.rollout_logprobs.clone()
    check_drift(logprob_drift(batch, trainer), RolloutConfig(), step=7)
    trainer[0, 1] = float("nan")
    with pytest.raises(TrainingDiverged, match=r"step 7: logprob_diff_mean = nan, logprob_diff_max = nan"):
        check_drift(logprob_drift(batch, trainer), RolloutConfig(), step=7)


def test_clip_fraction_counts_tokens_whatever_the_weights() -> None:
    algo = AlgorithmConfig(name="grpo", clip_ratio_low=0.2, clip_ratio_high=0.2)
    old = torch.zeros(1, 3)
    logprobs = torch.tensor([[math.log(1.5), 0.0, 0.0]])  # token 0 clipped (A > 0, ratio 1.5)
    # seq-mean-token-sum weights can sum past 1; the count stays a count.
    extras = {"old_logprobs": old, "advantages": torch.ones(1, 3), "weights": torch.tensor([[2.0, 2.0, 0.0]])}
    _, metrics = actor_loss(logprobs, extras, algo, 0.0)
    assert metrics["clipped_tokens"].item() == 1 and metrics["num_tokens"].item() == 2


def test_batch_select_and_concat() -> None:
    a = batch_of([0.0, 1.0], [1, 3])
    b = batch_of([0.5], [5])
    both = Batch.concat([a, b])
    assert both.mask.shape == (3, 6) and both.scores.tolist() == [0.0, 1.0, 0.5]
    assert both.mask.sum(dim=1).tolist() == [1, 3, 5]
    picked = both.select([2, 0])
    assert picked.sequences == [b.sequences[0], a.sequences[0]] and picked.mask.shape == (2, 6)
    short = both.select([0, 1])
    assert short.mask.shape == (2, 4)
    torch.testing.assert_close(short.rollout_logprobs, a.rollout_logprobs)


def policy_gradient(batch: Batch, old: torch.Tensor, advantages: torch.Tensor, algo: AlgorithmConfig
                    ) -> torch.Tensor:
    """d actor loss / d logprobs [N, T] at logprobs = old, the step's mask and weights as train.py makes them."""
    is_weights, kept, _ = rollout_correction(old, batch.rollout_logprobs, batch.mask, algo)
    weights = token_weights(actor_loss_mask(batch, kept), algo.loss_aggregation, max_tokens=8)
    logprobs = old.clone().requires_grad_()
    extras = {"old_logprobs": old, "advantages": advantages, "weights": weights, "is_weights": is_weights}
    loss, _ = actor_loss(logprobs, extras, algo, 0.0)
    loss.backward()
    assert logprobs.grad is not None
    return logprobs.grad


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("correction", ["seq_product_mis", "seq_geomean_mis"])
def test_rejected_sequences_leave_the_loss_and_its_denominators(mode: str, correction: str) -> None:
    """A sequence masked IS rejects changes nothing for the others: their gradient is the one of the batch without
    it (it is not counted as weight-0 tokens, which would shrink the gradient by the rejection rate)."""
    batch = batch_of([1.0, 0.0, 0.5], [2, 3, 1])
    advantages = torch.tensor([1.0, -1.0, 0.5])[:, None] * batch.mask
    old = batch.rollout_logprobs + 2.0 * batch.mask * torch.tensor([0.0, 1.0, 0.0])[:, None]  # sequence 1 far off
    algo = AlgorithmConfig(name="grpo", rollout_correction=correction, loss_aggregation=mode)  # type: ignore[arg-type]
    grad = policy_gradient(batch, old, advantages, algo)
    assert grad[1].abs().sum() == 0
    alone = batch.select([0, 2])
    width = alone.mask.shape[1]
    expected = policy_gradient(alone, old[[0, 2], :width], advantages[[0, 2], :width], algo)
    torch.testing.assert_close(grad[[0, 2], :width], expected)
    assert expected.abs().sum() > 0


def test_rejected_sequences_leave_the_critic_loss_but_filler_groups_stay() -> None:
    """A sequence the rollout correction rejects trains neither the actor nor the critic (its returns come from a
    sampler too far from the policy); a filler group, which teaches the actor nothing, still gives the critic value
    targets. The critic's gradient with a rejected sequence is the one of the batch without it."""
    batch = batch_of([1.0, 0.0, 0.5], [2, 3, 1])
    old = batch.rollout_logprobs + 2.0 * batch.mask * torch.tensor([0.0, 1.0, 0.0])[:, None]
    algo = AlgorithmConfig(name="ppo", rollout_correction="seq_product_mis")  # type: ignore[arg-type]
    _, kept, _ = rollout_correction(old, batch.rollout_logprobs, batch.mask, algo)
    filler = batch.as_filler()
    assert critic_loss_mask(filler, kept).sum() == kept.sum() > 0
    assert actor_loss_mask(filler, kept).sum() == 0
    returns = torch.tensor([1.0, -1.0, 0.5])[:, None] * batch.mask

    def value_gradient(b: Batch, mask: torch.Tensor, ret: torch.Tensor) -> torch.Tensor:
        values = torch.zeros_like(mask, requires_grad=True)
        weights = token_weights(mask, algo.loss_aggregation, 8)
        loss, _ = critic_loss(values, {"old_values": torch.zeros_like(mask), "returns": ret, "weights": weights}, algo)
        loss.backward()
        assert values.grad is not None
        return values.grad

    grad = value_gradient(batch, critic_loss_mask(batch, kept), returns)
    assert grad[1].abs().sum() == 0
    alone = batch.select([0, 2])
    width = alone.mask.shape[1]
    expected = value_gradient(alone, alone.mask, returns[[0, 2], :width])
    torch.testing.assert_close(grad[[0, 2], :width], expected)


def test_lora_dropout_enters_the_first_mini_batchs_ratio_against_the_whole_policy() -> None:
    """The decision (docs/training.md): old logprobs are the whole policy's (it sampled the batch, and scoring never
    drops), the update's are the dropped-out policy's, so on the first, on-policy mini-batch the ratio is
    exp(dropped - whole) and clipping counts the tokens dropout moves out of the trust region (a hand count);
    without dropout the ratio is 1 and nothing clips."""
    gen = torch.Generator().manual_seed(0)
    whole = -torch.rand(4, 6, generator=gen) * 3
    dropped = whole + torch.randn(4, 6, generator=gen) * 0.3  # what A's dropped-out input does to the logprobs
    adv = torch.randn(4, 6, generator=gen)
    extras = {"old_logprobs": whole, "advantages": adv, "weights": torch.full((4, 6), 1 / 24)}
    algo = AlgorithmConfig()
    _, off = actor_loss(whole, extras, algo, 0.0)
    _, on = actor_loss(dropped, extras, algo, 0.0)
    ratio = [math.exp(d - w) for d, w in zip(dropped.flatten().tolist(), whole.flatten().tolist(), strict=True)]
    by_hand = sum((r > 1.2 and a > 0) or (r < 0.8 and a < 0) for r, a in zip(ratio, adv.flatten().tolist(),
                                                                             strict=True))
    assert float(off["clipped_tokens"]) == 0 and float(on["clipped_tokens"]) == by_hand > 0


def test_a_bad_reward_return_on_one_rank_stops_every_rank_alike(monkeypatch):
    """The reward's return is checked where it returns, on the rank that scored it: that rank sends its paragraph
    through the scores' gather and raises it, and every other rank raises the same paragraph instead of waiting in
    the gather for scores that never come."""
    from megarl.loop import rollout_manager as rm

    sent = []

    def gather(part, world, group):
        sent.append(part)
        return [part, rm._Stopped("trainer.reward = 'm:f' returned None for sample 0")]

    monkeypatch.setattr(rm, "every_rank", gather)
    with pytest.raises(UserError, match="returned None for sample 0"):  # the other rank's, raised here
        rm.every_rank_or_stop(lambda: [1.0, 0.0], 2, None, UserError, str, UserError)

    def bad():
        raise UserError("trainer.reward = 'm:f' returned 'x' (a str) for sample 1")

    sent.clear()
    with pytest.raises(UserError, match="a str"):
        rm.every_rank_or_stop(bad, 2, None, UserError, str, UserError)
    assert sent == [rm._Stopped("trainer.reward = 'm:f' returned 'x' (a str) for sample 1")]
