"""PPO losses: clipped policy surrogate (with clip-higher and dual clip), clipped value loss, entropy.

Token tensors are [B, T] with `mask` [B, T] (float, 1 on response tokens). Each loss returns a
scalar to minimise; metrics are detached 0-d tensors, so reading them costs no device sync here.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean", "weighted"]

# Log-ratios are clamped (as verl does) so exp() cannot overflow on a token whose probability moved
# wildly; such a token, e^20 or e^-20 away from its old probability, then gets no gradient.
_MAX_LOG_RATIO = 20.0


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: Aggregation, max_tokens: int | None = None
              ) -> torch.Tensor:
    """Reduce per-token losses [B, T] over the tokens where mask [B, T] is 1 to a scalar.

    token-mean: sum / number of tokens, so every token weighs the same (long answers weigh more).
    seq-mean-token-sum: sum per sequence, then mean over sequences: no normaliser per sequence, so the
    loss grows with the response length.
    seq-mean-token-sum-norm: sum per sequence divided by the constant ``max_tokens`` (rollout.max_new_tokens),
    then mean over sequences: Dr. GRPO's form (Liu et al. 2025), whose normaliser depends on no response's
    length; seq-mean-token-sum scaled by 1 / max_tokens.
    seq-mean-token-mean: mean per sequence, then mean over sequences (the original GRPO).
    Sequences with an empty mask are left out of the mean over sequences; with no tokens at all the
    result is 0 (still attached to the graph).
    weighted: sum of loss * mask, where mask holds ``token_weights`` of the whole batch, so that
    micro-batches and data-parallel ranks add up to the aggregate of the global batch.
    """
    masked = loss_mat * mask
    if mode == "weighted":
        return masked.sum()
    if mode == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1)
    tokens = mask.sum(dim=1)
    per_seq = masked.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / tokens.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / _constant_normaliser(max_tokens)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"aggregate: unknown mode {mode!r}")
    nonempty = (tokens > 0).to(per_seq.dtype)
    return (per_seq * nonempty).sum() / nonempty.sum().clamp(min=1)


def token_weights(mask: torch.Tensor, mode: Aggregation, max_tokens: int | None = None) -> torch.Tensor:
    """Per-token weights [B, T] of the whole batch with sum(loss * w) == aggregate(loss, mask, mode, max_tokens)."""
    if mode == "token-mean":
        return mask / mask.sum().clamp(min=1)
    tokens = mask.sum(dim=1, keepdim=True)
    nonempty = (tokens > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return mask / nonempty
    if mode == "seq-mean-token-sum-norm":
        return mask / nonempty / _constant_normaliser(max_tokens)
    if mode == "seq-mean-token-mean":
        return mask / tokens.clamp(min=1) / nonempty
    raise ValueError(f"token_weights: unknown mode {mode!r}")


def _constant_normaliser(max_tokens: int | None) -> int:
    if max_tokens is None or max_tokens < 1:
        raise ValueError(f"seq-mean-token-sum-norm needs max_tokens >= 1 (rollout.max_new_tokens), got {max_tokens}")
    return max_tokens


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
    aggregation: Aggregation = "token-mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (Schulman et al. 2017) with separate clip ranges (DAPO clip-higher).

    logprobs (with grad), old_logprobs, advantages, mask: [B, T]. Per token, with r = exp(logp - old):
        loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
    and with dual_clip_c = c > 1, for A < 0 only: loss = min(loss, -c * A) (Ye et al. 2020), which
    bounds the loss of a negative-advantage token whose ratio has grown huge.
    is_weights [B, T] (no grad), when given, multiply each token's loss: rollout-mismatch correction
    (algos.correction), which reweights samples drawn from the engine towards the trainer's pi_old.
    Returns (loss scalar, metrics): clip_fraction = share of tokens whose gradient the clip removed
    (including dual-clipped ones), dual_clip_fraction, approx_kl = KL(old || new) by Schulman's k3.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clipped_out = clipped > unclipped
    dual = torch.zeros_like(clipped_out)
    if dual_clip_c is not None:
        bound = -dual_clip_c * advantages
        dual = (advantages < 0) & (loss_mat > bound)
        loss_mat = torch.where(dual, bound, loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    metrics = {
        "clip_fraction": _masked_mean((clipped_out | dual).float(), mask),
        "dual_clip_fraction": _masked_mean(dual.float(), mask),
        "approx_kl": _masked_mean((ratio - 1) - log_ratio, mask),
    }
    return aggregate(loss_mat, mask, aggregation), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    aggregation: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2).

    values (with grad), old_values, returns, mask: [B, T]; clip None = plain 0.5 * (V - R)^2.
    Returns (loss scalar, metrics): clip_fraction = share of tokens where the clipped error won.
    """
    error = (values - returns) ** 2
    if clip is None:
        return 0.5 * aggregate(error, mask, aggregation), {"clip_fraction": values.new_zeros(()).detach()}
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped_error = (clipped_values - returns) ** 2
    loss_mat = torch.maximum(error, clipped_error)
    metrics = {"clip_fraction": _masked_mean((clipped_error > error).float(), mask)}
    return 0.5 * aggregate(loss_mat, mask, aggregation), metrics


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation = "token-mean") -> torch.Tensor:
    """Aggregated token entropy [B, T] -> scalar; the caller subtracts entropy_coef times it from the loss."""
    return aggregate(entropy, mask, aggregation)
