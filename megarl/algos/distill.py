"""On-policy distillation: a teacher scores the student's own samples, and each sampled token's reverse KL is its
negative advantage (Thinking Machines' on-policy distillation; docs/algorithms.md)."""

from __future__ import annotations

import torch


def reverse_kl_advantages(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, coef: float,
                          offpolicy: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages [N, T]: -coef x (log pi_student - log pi_teacher) of each sampled token, on ``mask``
    (the policy's tokens; tool tokens and padding get 0), with no discount: a token is credited with its own
    divergence only. Their sum over a sample's tokens estimates the sequence's reverse KL, KL(student || teacher),
    which the policy gradient then lowers.

    ``student``: the trainer's old logprobs [N, T] (the sampling policy's, at the sampling temperature);
    ``teacher``: the teacher's logprobs of the same tokens at the same temperature [N, T]. Metrics: the mean reverse
    KL per token and the teacher's mean logprob of the sampled tokens. Under staleness (async_rl) ``offpolicy``
    (megarl.loop.rl_step.offpolicy_weights: [N, T] weights pi_prox / pi_behav and the tokens kept) weights both, as
    the ``kl`` metric: tokens an older policy drew estimate the student's divergence only so weighted."""
    rkl = (student - teacher) * mask
    weights, tokens = mask, mask.sum().clamp(min=1)
    if offpolicy is not None:
        weights, kept = offpolicy
        tokens = kept.sum().clamp(min=1)
    return -coef * rkl, {"distill/reverse_kl": float((rkl * weights).sum() / tokens),
                         "distill/teacher_logprob": float((teacher * mask * weights).sum() / tokens)}
