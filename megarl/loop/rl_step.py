"""The per-step RL computations between rollout and update, as functions of plain tensors.

Sequences are prompt + response token lists; per-token tensors are [N, T] with T = longest
sequence - 1, aligned with the *predicted* token (position t predicts token t+1), so response
token j of sequence i sits at column prompt_len_i - 1 + j.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megarl.algos.advantages import gae, grpo_advantages, whiten
from megarl.algos.kl import kl_estimate, kl_penalized_rewards
from megarl.algos.losses import aggregate, policy_loss, value_loss
from megarl.algos.shaping import overlong_penalty
from megarl.config import AlgorithmConfig, RolloutConfig
from megarl.errors import UserError, check_finite


@dataclass
class Batch:
    """One step's samples, every per-token tensor [N, T] aligned with predicted tokens."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    mask: torch.Tensor
    """1.0 on the policy's response tokens: all of a single-turn response, none of a multi-turn one's tool tokens
    (which go through the model as context but carry no logprob, loss, KL, entropy, value or advantage)."""
    rollout_logprobs: torch.Tensor
    scores: torch.Tensor
    """[N] outcome rewards."""
    informative: torch.Tensor
    """[N] 1.0, or 0.0 for DAPO's filler groups (dynamic sampling found too few prompts with signal), which only
    keep the batch at its configured size: the actor's loss leaves them out (actor_loss_mask)."""
    routing: list[np.ndarray] | None = None
    """MoE with routing replay: each sequence's [len-1, num_layers, k] experts, as the engine routed them."""
    stats: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Multi-turn rollouts: per-sample [N] statistics by name (megarl.rollout.agent.STATS); empty otherwise."""
    current: torch.Tensor | None = None
    """async_rl: [N, T] 1.0 on the response tokens that the weights being trained sampled (the others came from
    older ones); None = all of them (the sync loop)."""
    rewards: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per-sample [N] parts of ``scores`` by source when several make them up (reward_model.path: "rule", the
    rule reward, and "reward_model", the model's raw score); empty otherwise."""

    def as_filler(self) -> Batch:
        """These samples as filler: in the batch, out of the actor's loss."""
        return dataclasses.replace(self, informative=torch.zeros(len(self.sequences)))

    @staticmethod
    def build(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
              rollout_logprobs: Sequence[Sequence[float]], scores: Sequence[float],
              routing: Sequence[np.ndarray] | None = None, masks: Sequence[Sequence[int] | None] | None = None,
              stats: Sequence[Mapping[str, float] | None] | None = None) -> Batch:
        """``masks``: per response, 1 at the policy's tokens and 0 at tool tokens (None = all the policy's)."""
        sequences = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
        width = max(len(s) for s in sequences) - 1
        mask = torch.zeros(len(sequences), width)
        lp = torch.zeros(len(sequences), width)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            policy = masks[i] if masks is not None else None
            mask[i, len(p) - 1: len(p) - 1 + len(r)] = 1.0 if policy is None else torch.tensor(policy)
            lp[i, len(p) - 1: len(p) - 1 + len(r)] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
        if routing is not None:
            assert all(r.shape[0] == len(s) - 1 for r, s in zip(routing, sequences, strict=True))
        rows = [] if stats is None else [x for x in stats if x is not None]
        assert not rows or len(rows) == len(sequences), "stats for some samples only"
        return Batch(sequences, [len(p) for p in prompts], mask, lp, torch.tensor(scores, dtype=torch.float32),
                     torch.ones(len(sequences)), None if routing is None else list(routing),
                     {k: torch.tensor([x[k] for x in rows], dtype=torch.float32) for k in (rows[0] if rows else {})})

    def stack(self, rows: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Per-sequence [len-1] tensors by batch index -> [N, T], zero where no row is given."""
        out = torch.zeros_like(self.mask)
        for i, row in rows.items():
            out[i, : row.shape[0]] = row
        return out

    def rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[N, T] -> per-sequence [len-1] tensors."""
        return [x[i, : len(s) - 1] for i, s in enumerate(self.sequences)]

    def select(self, index: Sequence[int]) -> Batch:
        """The samples at ``index``, in that order, with T cut to the longest of them."""
        sequences = [self.sequences[i] for i in index]
        width = max(len(s) for s in sequences) - 1
        rows = torch.tensor(list(index), dtype=torch.long)
        return Batch(sequences, [self.prompt_lens[i] for i in index], self.mask[rows, :width],
                     self.rollout_logprobs[rows, :width], self.scores[rows], self.informative[rows],
                     None if self.routing is None else [self.routing[i] for i in index],
                     {k: v[rows] for k, v in self.stats.items()},
                     None if self.current is None else self.current[rows, :width],
                     {k: v[rows] for k, v in self.rewards.items()})

    @staticmethod
    def concat(parts: Sequence[Batch]) -> Batch:
        """The samples of ``parts`` one after the other, per-token tensors right-padded with zeros."""
        width = max(p.mask.shape[1] for p in parts)

        def cat(name: str) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(getattr(p, name), (0, width - p.mask.shape[1]))
                              for p in parts])

        routed = [p.routing for p in parts]
        assert len({r is None for r in routed}) == 1, "routing on some parts only"
        return Batch([s for p in parts for s in p.sequences], [n for p in parts for n in p.prompt_lens],
                     cat("mask"), cat("rollout_logprobs"), torch.cat([p.scores for p in parts]),
                     torch.cat([p.informative for p in parts]),
                     None if any(r is None for r in routed) else [x for r in routed if r is not None for x in r],
                     {k: torch.cat([p.stats[k] for p in parts]) for k in parts[0].stats},
                     None if any(p.current is None for p in parts) else cat("current"),
                     {k: torch.cat([p.rewards[k] for p in parts]) for k in parts[0].rewards})


def actor_loss_mask(batch: Batch, kept: torch.Tensor) -> torch.Tensor:
    """[N, T]: the response tokens the actor's loss counts, in its terms and in its denominators: those ``kept``
    by the rollout correction (algos.correction: not rejected), and not those of filler groups (no signal, so
    they would only dilute the informative samples' policy gradient)."""
    return kept * batch.informative[:, None]


def critic_loss_mask(batch: Batch, kept: torch.Tensor) -> torch.Tensor:
    """[N, T]: the response tokens the critic's loss counts: those ``kept`` by the rollout correction (a rejected
    sequence came from a sampler too far from the policy for its returns to be the policy's values). Unlike the
    actor's, filler groups count: their returns are value targets like any other."""
    return kept * batch.mask


def logprob_drift(batch: Batch, trainer_logprobs: torch.Tensor) -> dict[str, float]:
    """Rollout engine vs trainer log-probabilities of the sampled tokens (a broken weight update shows here), over
    the tokens sampled by the weights the trainer holds: older weights' tokens (async_rl) differ by the update."""
    mask = batch.mask if batch.current is None else batch.mask * batch.current
    diff = (batch.rollout_logprobs - trainer_logprobs).abs() * mask
    return {"logprob_diff_mean": float(diff.sum() / mask.sum().clamp(min=1)),
            "logprob_diff_max": float(diff.max())}


def check_drift(drift: dict[str, float], rollout: RolloutConfig, step: int) -> None:
    """Non-finite logprobs fail at any step; at step 0 the engine must run the trainer's weights: the largest gap
    within rollout.logprob_diff_max (bf16: the engine holds the trainer's bits) and the mean within
    rollout.logprob_diff_mean_max (with FP8 weights the mean alone: the largest gap is the quantization's tail)."""
    check_finite(f"step {step}", drift, "The trainer's or the engine's log-probabilities are not finite: check "
                 "the model's weights, the dtype (float16 overflows where bfloat16 does not) and the vocabulary "
                 "padding.")
    if step != 0:
        return
    bounds = [("logprob_diff_mean", "logprob_diff_mean_max", rollout.logprob_diff_mean_max)]
    if rollout.weight_dtype != "fp8":
        bounds.insert(0, ("logprob_diff_max", "logprob_diff_max", rollout.logprob_diff_max))
    for statistic, field, bound in bounds:
        if drift[statistic] > bound:
            raise UserError(f"step 0: rollout and trainer log-probabilities differ by up to "
                            f"{drift['logprob_diff_max']:.3f} (mean {drift['logprob_diff_mean']:.4f}), above "
                            f"rollout.{field} = {bound}. The engine is not running the trainer's weights (a broken "
                            "weight update, or a dtype/model mismatch); raise the bound only if the engine's "
                            "numerics are known to differ that much.")


def offpolicy_weights(batch: Batch, is_weights: torch.Tensor, kept: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """async_rl: ([N, T] importance weights pi_prox / pi_behav of the response tokens, [N, T] the tokens kept), for
    the terms of the step that average over sampled tokens and that the policy loss's correction does not reach: the
    KL to the reference (its loss and the ``kl`` metric, which adaptive_kl steers on), distill.form: loss, and the
    entropy metric. A stale token was drawn by an older policy, so a plain mean over the batch estimates these terms
    under that policy; weighted, under the proximal one. The weights are the policy's own: the step's
    algorithm.rollout_correction (``is_weights`` and ``kept`` from megarl.algos.correction.rollout_correction of the
    trainer's ``old_logprobs``, computed once a step), truncated or masked alike, so the terms and the policy
    gradient see one distribution. None in the sync loop (``batch.current`` None): there the sampler is the
    trainer's policy up to the engine's numerics, and these terms stay as they were, bit for bit."""
    return None if batch.current is None else (is_weights, kept)


def shaped_scores(batch: Batch, algo: AlgorithmConfig, max_new_tokens: int) -> torch.Tensor:
    """[N] outcome rewards plus DAPO's soft overlong penalty (off unless algorithm.overlong_buffer_tokens > 0).

    ``max_new_tokens`` is the response budget (Config.response_budget) and a response's length is what the budget
    counts, tool tokens included: a multi-turn sample cut by the budget is as long as it can be."""
    lengths = torch.tensor([len(s) - p for s, p in zip(batch.sequences, batch.prompt_lens, strict=True)])
    return batch.scores + overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer_tokens, algo.overlong_penalty)


def advantages_and_returns(batch: Batch, algo: AlgorithmConfig, group_size: int, kl_coef: float,
                           ref_logprobs: torch.Tensor | None, trainer_logprobs: torch.Tensor,
                           values: torch.Tensor | None, max_new_tokens: int, *,
                           offpolicy: tuple[torch.Tensor, torch.Tensor] | None, loss_mask: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Advantages [N, T] (and returns for the critic) for GRPO or KL-PPO with GAE.

    PPO whitens its advantages over ``loss_mask`` [N, T] (``actor_loss_mask``: the tokens the actor's loss counts),
    so that sequences the rollout correction rejects move neither the mean nor the scale of those it trains on.

    With kl_in_reward the KL estimate (algorithm.kl_estimator) times kl_coef is a reward: per token for
    PPO, and for GRPO summed over each response and subtracted from its score before the group
    normalisation (as verl does). Metrics: ``kl`` (the mean KL estimate per response token) and, with async_rl,
    ``entropy`` (-log pi_prox of the sampled tokens, mean per token), both weighted by ``offpolicy``
    (``offpolicy_weights``: None in the sync loop).
    """
    metrics: dict[str, float] = {}
    scores = shaped_scores(batch, algo, max_new_tokens)
    if algo.overlong_buffer_tokens:
        metrics["overlong_penalty"] = float((scores - batch.scores).mean())
    tokens = batch.mask.sum().clamp(min=1)
    weights = None
    if offpolicy is not None:  # the proximal policy's, not a mean of the stale samplers' (megarl.run.tracking's)
        # A mean over the tokens the correction keeps, as the loss takes: a sequence it rejects (weight 0) is not
        # a sample of the proximal policy, and counting its tokens would bias both metrics low.
        weights, kept = offpolicy
        tokens = kept.sum().clamp(min=1)
        metrics["entropy"] = float(-(trainer_logprobs * weights).sum() / tokens)
    kl = None
    if ref_logprobs is not None:
        # In the reward the KL is a reward like the score, corrected by the policy loss's weights; the metric is an
        # average over sampled tokens, so it takes the weights itself.
        kl = kl_estimate(trainer_logprobs, ref_logprobs, algo.kl_estimator) * batch.mask
        metrics["kl"] = float((kl if weights is None else kl * weights).sum() / tokens)
    coef = kl_coef if (kl is not None and algo.kl_in_reward) else 0.0
    if algo.name == "grpo":
        if kl is not None and coef:
            scores = scores - coef * kl.sum(dim=1)
        adv = grpo_advantages(scores, group_size, std_normalize=algo.grpo_std_normalize)
        return adv[:, None] * batch.mask, None, metrics
    assert values is not None, "PPO needs the critic's values"
    rewards = kl_penalized_rewards(scores, kl if kl is not None else torch.zeros_like(batch.mask),
                                   batch.mask, coef)
    adv, returns = gae(rewards, values * batch.mask, batch.mask, algo.gamma, algo.gae_lambda)
    return whiten(adv, loss_mask), returns, metrics


def actor_loss(logprobs: torch.Tensor, extras: dict[str, torch.Tensor], algo: AlgorithmConfig, kl_coef: float,
               entropy: torch.Tensor | None = None, distill_coef: float = 0.0
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted PPO/GRPO actor loss of one micro-batch.

    extras: old_logprobs, advantages, weights[, ref_logprobs][, is_weights][, teacher_logprobs][, offpolicy_weights]
    as [b, L-1]. With teacher_logprobs (distill.form: loss), distill_coef x the k2 estimate of the reverse KL to the
    teacher is added. offpolicy_weights (async_rl: ``offpolicy_weights``) weight each token's KL and distillation
    terms, which the policy's is_weights do not reach. Metrics are sums over micro-batches and ranks: the weighted
    losses, clipped_tokens / num_tokens (counts) and entropy_sum (over the counted tokens: mean_metrics divides).
    """
    w = extras["weights"]
    loss, _ = policy_loss(logprobs, extras["old_logprobs"], extras["advantages"], w, algo.clip_ratio_low,
                          algo.clip_ratio_high, algo.dual_clip_c, aggregation="weighted",
                          is_weights=extras.get("is_weights"))
    ratio = torch.exp((logprobs - extras["old_logprobs"]).clamp(-20, 20)).detach()
    adv = extras["advantages"]
    clipped = ((ratio > 1 + algo.clip_ratio_high) & (adv > 0)) | ((ratio < 1 - algo.clip_ratio_low) & (adv < 0))
    if algo.dual_clip_c is not None:  # the dual clip's tokens lose their gradient too (policy_loss's dual)
        clipped |= (adv < 0) & (ratio > algo.dual_clip_c)
    on = w > 0
    metrics = {"policy_loss": loss.detach(), "clipped_tokens": (clipped & on).sum().float(),
               "num_tokens": on.sum().float()}
    offpolicy = extras.get("offpolicy_weights")

    def sampled(term: torch.Tensor) -> torch.Tensor:
        return term if offpolicy is None else term * offpolicy

    if "ref_logprobs" in extras and not algo.kl_in_reward:  # in the reward, it is in the advantages already
        kl_loss = aggregate(sampled(kl_estimate(logprobs, extras["ref_logprobs"], algo.kl_estimator)), w, "weighted")
        loss = loss + kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    if "teacher_logprobs" in extras:
        distill_loss = aggregate(sampled(kl_estimate(logprobs, extras["teacher_logprobs"], "k2")), w, "weighted")
        loss = loss + distill_coef * distill_loss
        metrics["distill_loss"] = distill_loss.detach()
    if entropy is not None:
        ent = aggregate(entropy, w, "weighted")
        loss = loss - algo.entropy_coef * ent
        # The metric is the entropy per token whatever the aggregation (the bonus under seq-mean-token-sum is a
        # sequence's sum): a sum here, over the counted tokens in mean_metrics, as clip_fraction.
        metrics["entropy_sum"] = (entropy.detach() * on).sum()
    return loss, metrics


def critic_loss(values: torch.Tensor, extras: dict[str, torch.Tensor], algo: AlgorithmConfig
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, _ = value_loss(values, extras["old_values"], extras["returns"], extras["weights"], algo.value_clip,
                         aggregation="weighted")
    return loss, {"value_loss": loss.detach()}
