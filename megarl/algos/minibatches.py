"""How a rollout batch is cut into the mini-batches of an epoch's optimizer steps, and what those steps report."""

from __future__ import annotations

import numpy as np


def mini_batches(num_samples: int, size: int, seed: int, step: int, epoch: int) -> list[list[int]]:
    """The sample indices of each mini-batch of ``size`` in one epoch over ``num_samples`` samples.

    The samples are shuffled first, by a permutation of (seed, step, epoch) alone, so every rank cuts the
    same mini-batches and a resumed run the same as an uninterrupted one. Unshuffled, a mini-batch would
    hold neighbouring samples: a few prompts' groups, or only DAPO's filler groups at the end of the batch.
    One mini-batch per epoch keeps the batch's order (its update does not depend on it).
    """
    if size >= num_samples:
        return [list(range(num_samples))]
    order = np.random.default_rng([seed % 2**63, step, epoch]).permutation(num_samples).tolist()
    return [order[start: start + size] for start in range(0, num_samples, size)]


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """One update's metrics from its optimizer steps' (MegatronModel.train_step): the mean of each, lr the last
    step's, clip_fraction the share of all steps' tokens that were clipped and entropy their mean entropy (from
    the counts and sums actor_loss reports: clipped_tokens, entropy_sum, num_tokens)."""
    totals = {k: sum(s[k] for s in steps) for k in steps[0]}
    if "num_tokens" in totals:
        tokens = max(totals.pop("num_tokens"), 1.0) / len(steps)  # the mean below divides by len(steps) again
        totals["clip_fraction"] = totals.pop("clipped_tokens") / tokens
        if "entropy_sum" in totals:
            totals["entropy"] = totals.pop("entropy_sum") / tokens
    return {k: v / len(steps) for k, v in totals.items()} | {"lr": steps[-1]["lr"]}
