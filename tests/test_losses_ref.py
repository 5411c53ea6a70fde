"""GAE, GRPO, whitening, the actor and critic losses and the step-0 drift check against references written
as plain float64 Python loops, on batches with uneven masks, distinct gamma and lambda, several group sizes
and every flag that changes the arithmetic. The references never call the code under test: a sign, a
dropped term or a swapped argument in megarl.loop.rl_step or megarl.algos shows here as a wrong number."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megarl.algos.advantages import gae, grpo_advantages
from megarl.algos.losses import token_weights
from megarl.config import AlgorithmConfig, RolloutConfig
from megarl.errors import UserError
from megarl.loop.rl_step import Batch, actor_loss, advantages_and_returns, check_drift, critic_loss, logprob_drift

Rows = list[list[float]]


def tensor(rows: Rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def close(actual: torch.Tensor, expected: Rows | list[float] | float, atol: float = 1e-9) -> None:
    torch.testing.assert_close(actual.detach().double(), torch.tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=0)


def random_rows(rng: random.Random, n: int, t: int, lo: float, hi: float) -> Rows:
    return [[rng.uniform(lo, hi) for _ in range(t)] for _ in range(n)]


# ---- references: loops over Python floats ----

def ref_gae(rewards: Rows, values: Rows, mask: Rows, gamma: float, lam: float) -> tuple[Rows, Rows]:
    """Backwards over each row's response tokens only: a token off the mask neither bootstraps nor breaks the
    chain; the value after the last response token is 0."""
    advs, rets = [], []
    for r, v, m in zip(rewards, values, mask, strict=True):
        adv = [0.0] * len(r)
        next_value = next_adv = 0.0
        for t in reversed([t for t, on in enumerate(m) if on]):
            delta = r[t] + gamma * next_value - v[t]
            adv[t] = delta + gamma * lam * next_adv
            next_value, next_adv = v[t], adv[t]
        advs.append(adv)
        rets.append([a + v[t] if m[t] else 0.0 for t, a in enumerate(adv)])
    return advs, rets


def ref_whiten(x: Rows, mask: Rows) -> Rows:
    on = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if mask[i][t]]
    mean = sum(on) / len(on)
    var = sum((a - mean) ** 2 for a in on) / len(on)
    return [[(a - mean) / math.sqrt(var + 1e-8) if m else 0.0 for a, m in zip(row, mrow, strict=True)]
            for row, mrow in zip(x, mask, strict=True)]


def ref_kl(logp: float, ref: float, estimator: str) -> tuple[float, float]:
    """(estimate, d estimate / d logp) of KL(policy || reference) at one token."""
    if estimator == "k1":
        return logp - ref, 1.0
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2, logp - ref
    d = ref - logp
    value = math.exp(d) - d - 1
    return (10.0, 0.0) if value > 10 else (value, 1 - math.exp(d))


def ref_grpo(scores: list[float], group: int, std_normalize: bool) -> list[float]:
    out = []
    for g in range(0, len(scores), group):
        s = scores[g:g + group]
        mean = sum(s) / group
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / (group - 1))
        out += [(x - mean) / (std + 1e-6) if std_normalize else x - mean for x in s]
    return out


def ref_weights(mask: Rows, mode: str) -> Rows:
    tokens = [sum(row) for row in mask]
    nonempty = sum(1 for n in tokens if n)
    total = sum(tokens)
    if mode == "token-mean":
        return [[m / total for m in row] for row in mask]
    if mode == "seq-mean-token-sum":
        return [[m / nonempty for m in row] for row in mask]
    return [[m / n / nonempty if n else 0.0 for m in row] for row, n in zip(mask, tokens, strict=True)]


def ref_actor(logp: Rows, old: Rows, adv: Rows, w: Rows, algo: AlgorithmConfig, kl_coef: float,
              ref: Rows | None, entropy: Rows | None, is_w: Rows | None
              ) -> tuple[float, Rows, Rows, float, float]:
    """(loss, d loss / d logp, d loss / d entropy, clipped tokens, tokens) of the weighted actor loss."""
    low, high, c = algo.clip_ratio_low, algo.clip_ratio_high, algo.dual_clip_c
    loss, clipped, count = 0.0, 0.0, 0.0
    g_logp = [[0.0] * len(row) for row in logp]
    g_ent = [[0.0] * len(row) for row in logp]
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            r, a, weight = math.exp(logp[i][t] - old[i][t]), adv[i][t], w[i][t]
            scale = weight * (is_w[i][t] if is_w is not None else 1.0)
            unclipped, clip = -a * r, -a * min(max(r, 1 - low), 1 + high)
            token, grad = (unclipped, -a * r) if unclipped >= clip else (clip, 0.0)
            if c is not None and a < 0 and token > -c * a:
                token, grad = -c * a, 0.0
            loss += scale * token
            g_logp[i][t] += scale * grad
            if weight > 0:
                count += 1
                # tokens whose gradient a clip removes, the dual clip's among them
                clipped += (r > 1 + high and a > 0) or (r < 1 - low and a < 0) or (c is not None and a < 0 and r > c)
            if ref is not None and not algo.kl_in_reward:
                kl, dkl = ref_kl(logp[i][t], ref[i][t], algo.kl_estimator)
                loss += kl_coef * weight * kl
                g_logp[i][t] += kl_coef * weight * dkl
            if entropy is not None:
                loss -= algo.entropy_coef * weight * entropy[i][t]
                g_ent[i][t] = -algo.entropy_coef * weight
    return loss, g_logp, g_ent, clipped, count


# ---- advantages ----

@pytest.mark.parametrize("gamma,lam", [(0.9, 0.7), (0.5, 1.0), (1.0, 0.3)])
def test_gae_matches_loops_with_gaps_and_padding(gamma: float, lam: float) -> None:
    rng = random.Random(1)
    mask = [[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]]
    rewards, values = random_rows(rng, 4, 6, -1, 2), random_rows(rng, 4, 6, -1, 1)
    adv, ret = gae(tensor(rewards), tensor(values), tensor(mask), gamma, lam)
    want_adv, want_ret = ref_gae(rewards, values, mask, gamma, lam)
    close(adv, want_adv)
    close(ret, want_ret)


def ppo_batch() -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts of 2 and 3 tokens, responses of 3, 1 and 4 tokens; trainer, reference logprobs and values."""
    rng = random.Random(2)
    prompts, responses = [[1, 2], [1, 2, 3], [4, 5]], [[6, 7, 8], [9], [6, 6, 7, 7]]
    rollout = [[rng.uniform(-3, -0.1) for _ in r] for r in responses]
    batch = Batch.build(prompts, responses, rollout, [1.0, -0.5, 0.25])
    n, t = batch.mask.shape
    old = tensor(random_rows(rng, n, t, -3, -0.1)) * batch.mask
    ref = tensor(random_rows(rng, n, t, -3, -0.1)) * batch.mask
    values = tensor(random_rows(rng, n, t, -1, 1))
    return batch, old, ref, values


@pytest.mark.parametrize(("estimator", "kl_in_reward"),  # k1 in the loss is refused (test_config)
                         [("k1", True), ("k2", True), ("k3", True), ("k2", False), ("k3", False)])
def test_ppo_advantages_are_whitened_gae_of_kl_penalised_rewards(estimator: str, kl_in_reward: bool) -> None:
    batch, old, ref, values = ppo_batch()
    gamma, lam, coef = 0.95, 0.6, 0.3
    algo = AlgorithmConfig(name="ppo", gamma=gamma, gae_lambda=lam, kl_coef=coef, kl_in_reward=kl_in_reward,
                           kl_estimator=estimator)  # type: ignore[arg-type]
    adv, ret, metrics = advantages_and_returns(batch, algo, 1, coef, ref, old, values, max_new_tokens=8,
                                               offpolicy=None, loss_mask=batch.mask)
    mask, lp, rf, v = batch.mask.tolist(), old.tolist(), ref.tolist(), values.tolist()
    rewards = [[0.0] * len(row) for row in mask]
    kl_sum = 0.0
    for i, row in enumerate(mask):
        on = [t for t, m in enumerate(row) if m]
        for t in on:
            kl = ref_kl(lp[i][t], rf[i][t], estimator)[0]
            kl_sum += kl
            rewards[i][t] = -coef * kl if kl_in_reward else 0.0
        rewards[i][on[-1]] += batch.scores[i].item()
    raw, want_ret = ref_gae(rewards, [[x * m for x, m in zip(a, b, strict=True)] for a, b in zip(v, mask, strict=True)],
                            mask, gamma, lam)
    close(adv, ref_whiten(raw, mask), atol=1e-6)
    assert ret is not None
    close(ret, want_ret, atol=1e-6)  # the critic's targets are the raw advantages plus values, not whitened
    assert metrics["kl"] == pytest.approx(kl_sum / sum(map(sum, mask)), rel=1e-6)


def test_ppo_whitening_leaves_out_sequences_the_loss_leaves_out() -> None:
    """A sequence the rollout correction rejects is out of the loss: it must not move the mean or the scale of the
    others' whitened advantages, which are then those of the batch without it."""
    batch, old, ref, values = ppo_batch()
    algo = AlgorithmConfig(name="ppo", gamma=0.95, gae_lambda=0.6, kl_coef=0.3)
    kept = batch.mask.clone()
    kept[1] = 0
    adv, _, _ = advantages_and_returns(batch, algo, 1, 0.3, ref, old, values, max_new_tokens=8, offpolicy=None,
                                       loss_mask=kept)
    rows = [0, 2]
    alone = batch.select(rows)
    t = alone.mask.shape[1]
    want, _, _ = advantages_and_returns(alone, algo, 1, 0.3, ref[rows, :t], old[rows, :t], values[rows, :t],
                                        max_new_tokens=8, offpolicy=None, loss_mask=alone.mask)
    close(adv[rows, :t], want.tolist(), atol=1e-6)
    assert not adv[1].any()


@pytest.mark.parametrize("group,std_normalize", [(3, True), (5, True), (2, False), (5, False)])
@pytest.mark.parametrize("kl_in_reward", [True, False])
def test_grpo_advantages_match_loops(group: int, std_normalize: bool, kl_in_reward: bool) -> None:
    rng = random.Random(group)
    n = 2 * group
    scores = [float(rng.randint(0, 2)) for _ in range(n)]
    scores[group:] = [scores[group]] * group  # a group of equal scores: no signal unless the KL differs
    lengths = [rng.randint(1, 4) for _ in range(n)]
    batch = Batch.build([[1, 2]] * n, [[3] * k for k in lengths], [[-1.0] * k for k in lengths], scores)
    old = tensor(random_rows(rng, n, batch.mask.shape[1], -2, -0.1)) * batch.mask
    ref = tensor(random_rows(rng, n, batch.mask.shape[1], -2, -0.1)) * batch.mask
    coef = 0.2
    algo = AlgorithmConfig(name="grpo", kl_coef=coef, kl_in_reward=kl_in_reward, kl_estimator="k2",
                           grpo_std_normalize=std_normalize)
    adv, ret, _ = advantages_and_returns(batch, algo, group, coef, ref, old, None, max_new_tokens=8,
                                         offpolicy=None, loss_mask=batch.mask)
    assert ret is None
    mask, lp, rf = batch.mask.tolist(), old.tolist(), ref.tolist()
    shaped = [s - coef * sum(ref_kl(lp[i][t], rf[i][t], "k2")[0] for t, m in enumerate(mask[i]) if m)
              if kl_in_reward else s for i, s in enumerate(scores)]
    per_sample = ref_grpo(shaped, group, std_normalize)
    close(adv, [[a * m for m in row] for a, row in zip(per_sample, mask, strict=True)], atol=1e-6)
    close(grpo_advantages(torch.tensor(shaped, dtype=torch.float64), group, std_normalize), per_sample, atol=1e-6)


# ---- losses ----

def actor_case(seed: int) -> dict[str, Rows]:
    """Four sequences over 5 positions with padding and an empty row; ratios far enough from 1 that both
    clip sides, the dual clip and the k3 bound are reached."""
    rng = random.Random(seed)
    mask = [[1, 1, 1, 1, 0], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]
    old = random_rows(rng, 4, 5, -3, -0.2)
    log_ratio = [[rng.choice([-1.2, -0.5, -0.1, 0.05, 0.3, 0.9, 1.6]) for _ in range(5)] for _ in range(4)]
    logp = [[o + d for o, d in zip(a, b, strict=True)] for a, b in zip(old, log_ratio, strict=True)]
    adv = [[rng.choice([-2.0, -0.7, 0.4, 1.5]) for _ in range(5)] for _ in range(4)]
    ref = [[lp + rng.choice([-0.8, -0.2, 0.3, 3.0]) for lp in row] for row in logp]
    entropy = random_rows(rng, 4, 5, 0.1, 3.0)
    is_w = random_rows(rng, 4, 5, 0.5, 1.5)
    return {"mask": mask, "old": old, "logp": logp, "adv": adv, "ref": ref, "entropy": entropy, "is_w": is_w}


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("estimator", ["k2", "k3"])
@pytest.mark.parametrize("dual_clip_c,correction", [(None, False), (3.0, True)])
def test_actor_loss_with_kl_and_entropy_terms_matches_loops(aggregation: str, estimator: str,
                                                            dual_clip_c: float | None, correction: bool) -> None:
    """kl_in_reward: false (all three 8B recipes): the KL estimate of the reference enters the loss, with
    +kl_coef; the entropy bonus enters with -entropy_coef; each token's weight is its aggregation weight."""
    case = actor_case(seed=7)
    algo = AlgorithmConfig(name="grpo", clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=dual_clip_c,
                           kl_coef=0.4, kl_estimator=estimator, entropy_coef=0.05,  # type: ignore[arg-type]
                           loss_aggregation=aggregation)  # type: ignore[arg-type]
    mask = tensor(case["mask"])
    w = token_weights(mask, algo.loss_aggregation)
    close(w, ref_weights(case["mask"], aggregation))
    logp = tensor(case["logp"]).requires_grad_()
    entropy = tensor(case["entropy"]).requires_grad_()
    extras = {"old_logprobs": tensor(case["old"]), "advantages": tensor(case["adv"]), "weights": w,
              "ref_logprobs": tensor(case["ref"])}
    if correction:
        extras["is_weights"] = tensor(case["is_w"])
    loss, metrics = actor_loss(logp, extras, algo, 0.4, entropy)
    want, g_logp, g_ent, clipped, count = ref_actor(case["logp"], case["old"], case["adv"], w.tolist(), algo, 0.4,
                                                    case["ref"], case["entropy"],
                                                    case["is_w"] if correction else None)
    close(loss, want)
    loss.backward()
    assert logp.grad is not None and entropy.grad is not None
    close(logp.grad, g_logp)
    close(entropy.grad, g_ent)
    assert (metrics["clipped_tokens"].item(), metrics["num_tokens"].item()) == (clipped, count)
    assert metrics["kl_loss"].item() > 0 or estimator == "k1"
    # the entropy metric is per token whatever the aggregation (a sum here, mean_metrics divides by the count)
    counted = [e for row_e, row_w in zip(case["entropy"], w.tolist(), strict=True)
               for e, x in zip(row_e, row_w, strict=True) if x > 0]
    close(metrics["entropy_sum"], sum(counted), atol=1e-5)


def test_kl_in_the_reward_leaves_the_loss() -> None:
    case = actor_case(seed=3)
    algo = AlgorithmConfig(name="ppo", kl_coef=0.4, kl_in_reward=True)
    w = token_weights(tensor(case["mask"]), "token-mean")
    extras = {"old_logprobs": tensor(case["old"]), "advantages": tensor(case["adv"]), "weights": w,
              "ref_logprobs": tensor(case["ref"])}
    loss, metrics = actor_loss(tensor(case["logp"]), extras, algo, 0.4)
    want = ref_actor(case["logp"], case["old"], case["adv"], w.tolist(), algo, 0.4, case["ref"], None, None)[0]
    close(loss, want)
    assert "kl_loss" not in metrics


def test_clipped_tokens_count_both_sides_of_the_range() -> None:
    algo = AlgorithmConfig(name="grpo", clip_ratio_low=0.2, clip_ratio_high=0.3)
    # Ratios 1.5 (A > 0: clipped high), 0.5 (A < 0: clipped low), 0.5 (A > 0: not clipped), 1.5 (A < 0: not
    # clipped), 1.1 (inside), and a clipped-low token of weight 0 (off the batch's mask): 2 of 5.
    ratios, adv = [1.5, 0.5, 0.5, 1.5, 1.1, 0.5], [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    old = torch.zeros(1, 6, dtype=torch.float64)
    extras = {"old_logprobs": old, "advantages": tensor([adv]), "weights": tensor([[0.2] * 5 + [0.0]])}
    _, metrics = actor_loss(torch.log(tensor([ratios])), extras, algo, 0.0)
    assert (metrics["clipped_tokens"].item(), metrics["num_tokens"].item()) == (2, 5)


@pytest.mark.parametrize("clip", [None, 0.15])
def test_critic_loss_matches_loops(clip: float | None) -> None:
    rng = random.Random(5)
    mask = [[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0]]
    values, old, returns = (random_rows(rng, 3, 4, -1, 1) for _ in range(3))
    w = ref_weights(mask, "seq-mean-token-mean")
    want, grad = 0.0, [[0.0] * 4 for _ in range(3)]
    for i in range(3):
        for t in range(4):
            v, o, r = values[i][t], old[i][t], returns[i][t]
            vc = v if clip is None else o + min(max(v - o, -clip), clip)
            if (v - r) ** 2 >= (vc - r) ** 2:
                want += 0.5 * w[i][t] * (v - r) ** 2
                grad[i][t] = w[i][t] * (v - r)
            else:  # the clipped error wins: no gradient through V (vc is constant in V there)
                want += 0.5 * w[i][t] * (vc - r) ** 2
    v = tensor(values).requires_grad_()
    algo = AlgorithmConfig(name="ppo", value_clip=clip)
    loss, _ = critic_loss(v, {"old_values": tensor(old), "returns": tensor(returns), "weights": tensor(w)}, algo)
    close(loss, want)
    loss.backward()
    assert v.grad is not None
    close(v.grad, grad)


# ---- the step-0 check that the engine runs the trainer's weights ----

def test_step_zero_refuses_engine_logprobs_that_disagree_with_the_trainer() -> None:
    batch = Batch.build([[1, 2]] * 2, [[3, 4], [5]], [[-1.0, -2.0], [-0.5]], [0.0, 1.0])
    trainer = batch.rollout_logprobs.clone()
    trainer[0, 2] -= 0.3  # one token 0.3 away: the engine is not running the trainer's weights
    drift = logprob_drift(batch, trainer)
    assert drift["logprob_diff_max"] == pytest.approx(0.3, abs=1e-6)
    assert drift["logprob_diff_mean"] == pytest.approx(0.1, abs=1e-6)
    with pytest.raises(UserError, match=r"step 0: .* differ by up to 0\.300 .* rollout\.logprob_diff_max = 0\.1"):
        check_drift(drift, RolloutConfig(logprob_diff_max=0.1), step=0)
    with pytest.raises(UserError, match=r"mean 0\.1000\), above rollout\.logprob_diff_mean_max = 0\.05"):
        check_drift(drift, RolloutConfig(logprob_diff_mean_max=0.05), step=0)
    check_drift(drift, RolloutConfig(logprob_diff_max=0.5), step=0)  # within the bounds
    check_drift(drift, RolloutConfig(logprob_diff_max=0.1), step=3)  # step 0's bounds: later steps report metrics


def test_step_zero_with_fp8_weights_bounds_the_mean_gap_not_the_tail() -> None:
    """An FP8 sampler's largest gap over a step's tokens is the quantization's tail (3.3 on SmolLM2-135M at a mean
    of 0.14, on an H100): the check takes the mean, which wrong weights move for every token."""
    batch = Batch.build([[1, 2]] * 2, [[3, 4], [5]], [[-1.0, -2.0], [-0.5]], [0.0, 1.0])
    trainer = batch.rollout_logprobs.clone()
    trainer[0, 2] -= 3.0  # one token in the tail: mean 1.0 over the three
    drift = logprob_drift(batch, trainer)
    with pytest.raises(UserError, match=r"rollout\.logprob_diff_max = 2\.0"):
        check_drift(drift, RolloutConfig(logprob_diff_mean_max=1.5), step=0)  # bf16: the tail is a broken weight
    check_drift(drift, RolloutConfig(weight_dtype="fp8", logprob_diff_mean_max=1.5), step=0)
    with pytest.raises(UserError, match=r"mean 1\.0000\), above rollout\.logprob_diff_mean_max = 0\.5"):
        check_drift(drift, RolloutConfig(weight_dtype="fp8", logprob_diff_mean_max=0.5), step=0)
