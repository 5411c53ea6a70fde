"""On-policy distillation: a teacher scores the student's own samples, and each sampled token's reverse KL is its
negative advantage (Thinking Machines' on-policy distillation; docs/algorithms.md)."""

from __future__ import annotations

import torch


def reverse_kl_advantages(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, coef: float
                          ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages [N, T]: -coef x (log pi_student - log pi_teacher) of each sampled token, on ``mask``
    (the policy's tokens; tool tokens and padding get 0), with no discount: a token is credited with its own
    divergence only. Their sum over a sample's tokens estimates the sequence's reverse KL, KL(student || teacher),
    which the policy gradient then lowers.

    ``student``: the trainer's old logprobs [N, T] (the sampling policy's, at the sampling temperature);
    ``teacher``: the teacher's logprobs of the same tokens at the same temperature [N, T]. Metrics: the mean reverse
    KL per token and the teacher's mean logprob of the sampled tokens."""
    rkl = (student - teacher) * mask
    tokens = mask.sum().clamp(min=1)
    return -coef * rkl, {"distill/reverse_kl": float(rkl.sum() / tokens),
                         "distill/teacher_logprob": float((teacher * mask).sum() / tokens)}
