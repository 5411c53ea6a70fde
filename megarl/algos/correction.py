"""Rollout-mismatch correction: importance weights from the engine's distribution to the trainer's.

The engine samples from pi_rollout, which never equals the trainer's pi_old exactly (other kernels,
bf16, FP8 rollout). PPO's ratio pi / pi_old assumes the samples came from pi_old; weighting each
token's loss by pi_old / pi_rollout, truncated, corrects for the difference (truncated importance
sampling, Yao et al. 2025; masked IS rejects sequences instead). Token tensors are [B, T] with
`mask` [B, T] (float, 1 on response tokens); the weights are targets, so no autograd here.
"""

from __future__ import annotations

from typing import Literal

import torch

from megarl.config import AlgorithmConfig

Mode = Literal["none", "token_tis", "seq_product_tis", "seq_product_mis", "seq_geomean_tis", "seq_geomean_mis"]

_MAX_LOG_RATIO = 20.0


@torch.no_grad()
def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``rollout_correction_weights`` as algorithm.rollout_correction sets it, with the product modes' own cap."""
    product = algo.rollout_correction.startswith("seq_product")
    cap = algo.rollout_correction_product_cap if product else algo.rollout_correction_cap
    return rollout_correction_weights(old_logprobs, rollout_logprobs, mask, algo.rollout_correction, cap)


@torch.no_grad()
def rollout_correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                               mode: Mode, cap: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-token loss weights [B, T] (0 off the mask), the tokens that stay in the loss [B, T], and statistics.

    With log-ratio d_t = old_t - rollout_t (clamped to [-20, 20]), per sequence the importance ratio
    r_prod = exp(sum of d_t over its response tokens, clamped to [-20, 20]) (verl's sequence level) and the
    geometric mean ratio r_geo = exp(mean of d_t), which stays close to 1 on long responses:
      token_tis:       w_t = min(exp(d_t), cap)
      seq_product_tis: w_t = min(r_prod, cap) on every token of the sequence
      seq_product_mis: w_t = r_prod when 1/cap <= r_prod <= cap, else the sequence is rejected
      seq_geomean_tis, seq_geomean_mis: the same with r_geo
      none:            w_t = 1
    A rejected sequence leaves the loss altogether: weight 0, and out of the tokens kept (``mask`` less the
    rejected sequences), which the loss's denominators count, so rejections do not shrink the gradient.
    Metrics (over response tokens): token_ratio_min / token_ratio_max of exp(d_t), logged in every
    mode as a measure of the mismatch; weight_mean, weight_min, weight_max; truncated_fraction, the share
    of tokens whose weight the cap changed (truncated or rejected); rejected_fraction, the share rejected.
    """
    if cap <= 1:
        raise ValueError(f"rollout_correction_weights: cap {cap} must be > 1")
    on = mask > 0
    log_ratio = ((old_logprobs - rollout_logprobs) * mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    tokens = mask.sum(dim=1, keepdim=True)
    token_ratio = log_ratio.exp()
    kept = mask
    if mode == "none":
        raw = torch.ones_like(mask)
        weights = raw
    elif mode == "token_tis":
        raw = token_ratio
        weights = raw.clamp(max=cap)
    elif mode in ("seq_product_tis", "seq_product_mis", "seq_geomean_tis", "seq_geomean_mis"):
        log_seq = log_ratio.sum(dim=1, keepdim=True)
        if mode.startswith("seq_geomean"):
            log_seq = log_seq / tokens.clamp(min=1)
        raw = log_seq.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp().expand_as(mask)
        if mode.endswith("tis"):
            weights = raw.clamp(max=cap)
        else:
            inside = (raw <= cap) & (raw >= 1 / cap)
            weights = torch.where(inside, raw, torch.zeros_like(raw))
            kept = mask * inside
    else:
        raise ValueError(f"rollout_correction_weights: unknown mode {mode!r}")
    weights = weights * mask
    count = on.sum().clamp(min=1)
    if not bool(on.any()):
        return weights, kept, {"token_ratio_min": 1.0, "token_ratio_max": 1.0, "weight_mean": 1.0,
                               "weight_min": 1.0, "weight_max": 1.0, "truncated_fraction": 0.0,
                               "rejected_fraction": 0.0}
    metrics = {
        "token_ratio_min": float(token_ratio[on].min()),
        "token_ratio_max": float(token_ratio[on].max()),
        "weight_mean": float(weights.sum() / count),
        "weight_min": float(weights[on].min()),
        "weight_max": float(weights[on].max()),
        "truncated_fraction": float(((weights != raw) & on).sum() / count),
        "rejected_fraction": float(((kept == 0) & on).sum() / count),
    }
    return weights, kept, metrics
