"""Advantage estimators: GAE for PPO, group-normalised outcome rewards for GRPO, masked whitening.

Token tensors are [B, T] with `mask` [B, T] (float, 1 on response tokens). Advantages are targets,
so everything here runs without autograd.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens.

    rewards, values, mask: [B, T]. Returns (advantages [B, T], returns [B, T]), both 0 where mask is 0;
    returns = advantages + values. The value after a sequence's last response token is 0 (the episode
    ends there). Tokens with mask 0 inside a response (e.g. tool output between turns) are skipped:
    the bootstrap value and the running advantage pass through them unchanged.
    """
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(batch)
    next_advantage = rewards.new_zeros(batch)
    on = mask.bool()
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(on[:, t], values[:, t], next_value)
        next_advantage = torch.where(on[:, t], advantage, next_advantage)
        advantages[:, t] = advantage * mask[:, t]
    return advantages, (advantages + values) * mask


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Outcome advantages relative to the other samples of the same prompt (Shao et al. 2024).

    scores: [N], N = prompts * group_size, the samples of one prompt adjacent. Returns [N]:
    (score - group mean) / (group std + eps), with the unbiased std as in DeepSeekMath, verl and TRL;
    std_normalize=False subtracts the mean only (Dr. GRPO, Liu et al. 2025), which avoids up-weighting
    prompts that are nearly always solved or always failed. A group whose scores are all equal gets 0.
    """
    if group_size < 2 or scores.numel() % group_size:
        raise ValueError(f"grpo_advantages: {scores.numel()} scores do not form groups of {group_size} (>= 2)")
    # In float32 the mean of equal scores such as 0.1 can be off by a rounding step, which std-normalising would
    # blow up into an advantage of a few percent for a group with no signal: float64, and equal groups set to 0.
    groups = scores.reshape(-1, group_size).double()
    centred = groups - groups.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    centred = torch.where((groups == groups[:, :1]).all(dim=1, keepdim=True), 0.0, centred)
    return centred.reshape(-1).to(scores.dtype)


@torch.no_grad()
def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the tokens where mask is 1 (population variance); 0 elsewhere.

    x, mask: [B, T] -> [B, T]. Statistics are over this batch only; whiten the whole rollout batch
    at once, not each micro-batch.
    """
    count = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / count
    var = ((x - mean) ** 2 * mask).sum() / count
    return (x - mean) * torch.rsqrt(var + eps) * mask
