"""Bradley-Terry reward modelling: P(chosen > rejected) = sigmoid(r_chosen - r_rejected).

Pairs are [P] tensors of the reward model's scalar scores (each response scored at its last token). The loss couples
the two scores of a pair, while megarl's trainer computes losses per sequence (micro-batches, packing, pipeline
stages and DP ranks split pairs apart). Its gradient does not need the pair in one micro-batch:
d/dr_c [-log sigmoid(r_c - r_r)] = -sigmoid(r_r - r_c) and d/dr_r = +sigmoid(r_r - r_c). So a step scores every
response first, then trains on each score alone with ``surrogate_weights`` held fixed: the gradient of
sum_i w_i r_i is the Bradley-Terry loss's, exactly, at the scored weights.
"""

from __future__ import annotations

import torch


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean over pairs of -log sigmoid(chosen - rejected) for scores ``chosen``, ``rejected`` [P], and the pairs'
    statistics: ``accuracy`` (the share ranked right, a tie counting half), ``margin`` (mean chosen - rejected),
    ``chosen`` and ``rejected`` (mean scores)."""
    if chosen.shape != rejected.shape or chosen.dim() != 1 or chosen.numel() == 0:
        raise ValueError(f"bradley_terry: chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must be "
                         "the same non-empty [P]")
    diff = chosen.float() - rejected.float()
    loss = -torch.nn.functional.logsigmoid(diff).mean()
    diff, right = diff.detach(), (diff > 0).float() + 0.5 * (diff == 0).float()
    return loss, {"accuracy": float(right.mean()), "margin": float(diff.mean()),
                  "chosen": float(chosen.detach().float().mean()), "rejected": float(rejected.detach().float().mean())}


def surrogate_weights(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response weights ([P] for the chosen, [P] for the rejected; no grad) whose weighted sum of scores,
    sum w_c r_c + w_r r_r, has the gradient of P x ``bradley_terry``'s loss: w_c = -sigmoid(r_r - r_c), w_r = -w_c.
    Divide by the number of pairs of the whole batch (all DP ranks) for the mean's gradient."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"surrogate_weights: chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} "
                         "differ")
    w = -torch.sigmoid(rejected.detach().float() - chosen.detach().float())
    return w, -w
