"""Rollout-mismatch correction: importance weights from the engine's distribution to the trainer's.

The engine samples from pi_rollout, which never equals the trainer's pi_old exactly (other kernels,
bf16, FP8 rollout). PPO's ratio pi / pi_old assumes the samples came from pi_old; weighting each
token's loss by pi_old / pi_rollout, truncated, corrects for the difference (truncated importance
sampling, Yao et al. 2025; masked IS drops sequences instead). Token tensors are [B, T] with
`mask` [B, T] (float, 1 on response tokens); the weights are targets, so no autograd here.
"""

from __future__ import annotations

from typing import Literal

import torch

Mode = Literal["none", "token_tis", "seq_tis", "seq_mis"]

_MAX_LOG_RATIO = 20.0


@torch.no_grad()
def rollout_correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                               mode: Mode, cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token loss weights [B, T] (0 off the mask) and their statistics.

    With log-ratio d_t = old_t - rollout_t (clamped to [-20, 20]) and, per sequence, the geometric
    mean ratio r_seq = exp(mean of d_t over its response tokens):
      token_tis: w_t = min(exp(d_t), cap)
      seq_tis:   w_t = min(r_seq, cap) on every token of the sequence
      seq_mis:   w_t = r_seq when 1/cap <= r_seq <= cap, else 0 (the sequence is dropped)
      none:      w_t = 1
    Metrics (over response tokens): token_ratio_min / token_ratio_max of exp(d_t), logged in every
    mode as a measure of the mismatch; weight_mean, weight_min, weight_max; and truncated_fraction,
    the share of tokens whose weight the cap changed (truncated, or dropped by seq_mis).
    """
    if cap <= 1:
        raise ValueError(f"rollout_correction_weights: cap {cap} must be > 1")
    on = mask > 0
    log_ratio = ((old_logprobs - rollout_logprobs) * mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    tokens = mask.sum(dim=1, keepdim=True)
    token_ratio = log_ratio.exp()
    if mode == "none":
        raw = torch.ones_like(mask)
        weights = raw
    elif mode == "token_tis":
        raw = token_ratio
        weights = raw.clamp(max=cap)
    elif mode in ("seq_tis", "seq_mis"):
        seq = (log_ratio.sum(dim=1, keepdim=True) / tokens.clamp(min=1)).exp()
        raw = seq.expand_as(mask)
        if mode == "seq_tis":
            weights = raw.clamp(max=cap)
        else:
            weights = torch.where((raw <= cap) & (raw >= 1 / cap), raw, torch.zeros_like(raw))
    else:
        raise ValueError(f"rollout_correction_weights: unknown mode {mode!r}")
    weights = weights * mask
    count = on.sum().clamp(min=1)
    if not bool(on.any()):
        return weights, {"token_ratio_min": 1.0, "token_ratio_max": 1.0, "weight_mean": 1.0, "weight_min": 1.0,
                         "weight_max": 1.0, "truncated_fraction": 0.0}
    metrics = {
        "token_ratio_min": float(token_ratio[on].min()),
        "token_ratio_max": float(token_ratio[on].max()),
        "weight_mean": float(weights.sum() / count),
        "weight_min": float(weights[on].min()),
        "weight_max": float(weights[on].max()),
        "truncated_fraction": float(((weights != raw) & on).sum() / count),
    }
    return weights, metrics
