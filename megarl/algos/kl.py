"""KL(policy || reference) per token (Schulman's k1/k2/k3), KL-penalised rewards, KL coefficient control.

Token tensors are [B, T] with `mask` [B, T] (float, 1 on response tokens). Tokens are sampled from the
policy, so each estimator's mean over samples estimates KL(policy || reference):
http://joschu.net/blog/kl-approx.html
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch

from megarl.config import AlgorithmConfig

Estimator = Literal["k1", "k2", "k3"]

# exp(20) is about 5e8: far beyond any useful penalty, yet finite in bf16 and float32.
_MAX_LOG_RATIO = 20.0
# Bound on the k3 estimate itself (as verl and OpenRLHF do): a token whose reference probability is
# e^20 times its policy probability would otherwise contribute ~5e8 and dominate a whole update.
_MAX_K3 = 10.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Estimator | None) -> torch.Tensor:
    """Per-token KL estimate [B, T] from policy and reference logprobs of the sampled tokens [B, T].

    k1 = logp - logp_ref (unbiased, high variance, can be negative);
    k2 = 0.5 * (logp - logp_ref)^2 (biased, low variance, >= 0);
    k3 = exp(d) - d - 1 with d = logp_ref - logp clamped to [-20, 20], then clamped to at most 10
    (unbiased up to that bound, low variance, >= 0; a clamped token gets no gradient).
    None is refused: AlgorithmConfig resolves an unset estimator by where the KL goes.
    """
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff**2
    if estimator == "k3":
        d = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(d) - d - 1).clamp(max=_MAX_K3)
    raise ValueError(f"kl_estimate: unknown estimator {estimator!r} (k1, k2 or k3)")


@torch.no_grad()
def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Token rewards [B, T] for PPO with the KL penalty in the reward (Ziegler et al. 2019).

    scores: [B] outcome rewards; kl, mask: [B, T]. Every response token gets -kl_coef * kl, and the
    last response token of each sequence also gets its score. A sequence with an empty mask gets nothing.
    """
    rewards = -kl_coef * kl * mask
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).amax(dim=1)
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    rewards[rows, last[has_tokens]] += scores[has_tokens].to(rewards.dtype)
    return rewards


class KLController(ABC):
    """Holds the KL coefficient `value` that trainers read each step."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    @abstractmethod
    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust `value` after a batch of n_steps samples whose mean KL was current_kl."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class FixedKLController(KLController):
    """A constant KL coefficient: the config's, also on resume (checkpoint.allow_changes may change it)."""

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def load_state_dict(self, state: dict[str, float]) -> None:
        pass


class AdaptiveKLController(KLController):
    """Steer the KL coefficient so the measured KL tracks `target` (Ziegler et al. 2019, section 2.2).

    After a batch of n_steps samples with mean KL current_kl:
        error = clip(current_kl / target - 1, -0.2, 0.2);  coef *= 1 + error * n_steps / horizon
    The clip bounds how fast the coefficient can move on one noisy batch.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        super().__init__(init_coef)
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(cfg: AlgorithmConfig) -> KLController:
    """The controller for `algorithm.kl_coef` (adaptive when `algorithm.adaptive_kl`)."""
    if cfg.adaptive_kl:
        assert cfg.kl_target is not None  # AlgorithmConfig checks this
        return AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    return FixedKLController(cfg.kl_coef)
