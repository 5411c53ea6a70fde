"""The actor's update splits the rollout batch into shuffled mini-batches (the same on every rank and in a resumed
run), and DAPO's filler groups weigh nothing in it: every optimizer step follows informative samples only."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megarl.algos.minibatches import mean_metrics, mini_batches
from megarl.config import build_config
from megarl.loop.learner import Learner
from megarl.loop.rl_step import Batch, actor_loss_mask, advantages_and_returns

GROUP = 4


class RecordingModel:
    """Stands in for MegatronModel: records what each optimizer step trains on."""

    replay = None

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.skipped = 0

    def skip_step(self) -> None:
        self.skipped += 1

    def train_step(self, sequences: list[list[int]], extras: dict[str, list[torch.Tensor]], *args: Any,
                   **kwargs: Any) -> dict[str, float]:
        self.steps.append({"samples": [s[0] for s in sequences], **extras})
        return {"lr": 1.0, "loss": 0.0}


def trainer_over(model: RecordingModel, dp_rank: int = 0, dp: int = 1, epochs: int = 1,
                 aggregation: str = "token-mean") -> Learner:
    cfg = build_config({"model": {"hf_path": "m"}, "data": {"train_path": "d", "num_prompts_per_step": 8},
                        "rollout": {"num_samples_per_prompt": GROUP, "max_new_tokens": 6},
                        "actor": {"mini_batch_size": 8, "num_ppo_epochs": epochs},
                        "algorithm": {"loss_aggregation": aggregation}})
    trainer = Learner.__new__(Learner)  # the update's plumbing only: no models, engines or process groups
    trainer.cfg, trainer.actor = cfg, model  # type: ignore[assignment]
    trainer.groups = SimpleNamespace(dp_rank=dp_rank, dims=SimpleNamespace(dp=dp))  # type: ignore[assignment]
    trainer.residency = SimpleNamespace(hold=lambda needs: None)  # type: ignore[assignment]
    return trainer


def dapo_batch() -> Batch:
    """8 prompts x 4 samples: 5 informative groups, then 3 filler groups (all scored 0), as generate() appends
    them. Sample i's sequence starts with token i, so its place in a mini-batch can be traced."""
    def part(first: int, scores: list[float]) -> Batch:
        n = len(scores)
        return Batch.build([[first + i, 7] for i in range(n)], [[3] * (1 + (first + i) % 3) for i in range(n)],
                           [[-1.0] * (1 + (first + i) % 3) for i in range(n)], scores)

    informative = part(0, [1.0, 0.0, 0.0, 0.0] * 5)
    return Batch.concat([informative, part(20, [0.0] * 12).as_filler()])


def update(trainer: Learner, batch: Batch, step: int) -> None:
    algo = trainer.cfg.algorithm
    advantages, _, _ = advantages_and_returns(batch, algo, GROUP, 0.0, None, batch.rollout_logprobs, None, 8,
                                             offpolicy=None, loss_mask=batch.mask)
    extras = {"old_logprobs": batch.rollout_logprobs, "advantages": advantages}
    trainer.update_actor(batch, extras, step, actor_loss_mask(batch, batch.mask))


def test_a_mini_batch_of_filler_alone_takes_no_optimizer_step() -> None:
    """One informative prompt among eight: shuffled mini-batches of two prompts often hold filler alone. Such a step
    had a zero gradient, but Adam's momentum and weight decay still moved the weights."""
    def part(first: int, scores: list[float]) -> Batch:
        n = len(scores)
        return Batch.build([[first + i, 7] for i in range(n)], [[3, 3] for _ in range(n)],
                           [[-1.0, -1.0] for _ in range(n)], scores)

    batch = Batch.concat([part(0, [1.0, 0.0, 0.0, 0.0]), part(4, [0.0] * 28).as_filler()])
    model = RecordingModel()
    for step in range(20):
        update(trainer_over(model), batch, step)
    assert len(model.steps) + model.skipped == 20 * 4 and model.skipped > 0
    assert all(any(i < 4 for i in s["samples"]) for s in model.steps)  # each step holds the informative group


def test_every_optimizer_step_has_policy_gradient_signal_and_filler_weighs_nothing() -> None:
    batch, model = dapo_batch(), RecordingModel()
    for step in range(5):
        update(trainer_over(model), batch, step)
    assert len(model.steps) == 5 * 4  # 32 samples in mini-batches of 8
    for k, s in enumerate(model.steps):
        # Unshuffled, the last mini-batch of each step would hold filler groups 6 and 7 alone (advantage 0).
        assert any(bool(a.abs().sum() > 0) for a in s["advantages"]), (k, s["samples"])
        weights = dict(zip(s["samples"], s["weights"], strict=True))
        assert all(float(w.abs().sum()) == 0 for i, w in weights.items() if i >= 20), k
        # token-mean over the informative tokens of the mini-batch alone: their weights add up to 1.
        assert abs(sum(float(w.sum()) for i, w in weights.items() if i < 20) - 1) < 1e-6, k
    assert len({tuple(s["samples"]) for s in model.steps}) == len(model.steps)  # steps and epochs differ


def test_mini_batches_are_a_partition_each_epoch_and_the_same_on_every_rank_and_rerun() -> None:
    batch = dapo_batch()
    ranks = [RecordingModel(), RecordingModel()]
    for rank, model in enumerate(ranks):
        update(trainer_over(model, dp_rank=rank, dp=2, epochs=2), batch, step=3)
    again = RecordingModel()
    update(trainer_over(again, dp_rank=0, dp=2, epochs=2), batch, step=3)
    assert [s["samples"] for s in again.steps] == [s["samples"] for s in ranks[0].steps]
    parts = [sorted(a["samples"] + b["samples"]) for a, b in zip(*(m.steps for m in ranks), strict=True)]
    assert all(len(p) == 8 for p in parts)  # each rank trains on its half of the same mini-batch
    for epoch in (parts[:4], parts[4:]):
        assert sorted(i for p in epoch for i in p) == sorted(s[0] for s in batch.sequences)
    assert parts[:4] != parts[4:]


def test_dr_grpo_weights_divide_by_max_new_tokens() -> None:
    """seq-mean-token-sum-norm: every counted token of a mini-batch weighs 1 / (its sequences x max_new_tokens)."""
    model = RecordingModel()
    update(trainer_over(model, aggregation="seq-mean-token-sum-norm"), dapo_batch(), step=0)
    for s in model.steps:
        counted = {i: w for i, w in zip(s["samples"], s["weights"], strict=True) if i < 20}
        for i, w in counted.items():  # sample i has 1 + i % 3 response tokens
            assert int((w > 0).sum()) == 1 + i % 3
            assert torch.allclose(w[w > 0], torch.tensor(1 / (len(counted) * 6))), (i, w)


def test_one_mini_batch_keeps_the_batch_order() -> None:
    assert mini_batches(6, 6, seed=1, step=2, epoch=0) == [list(range(6))]
    assert mini_batches(6, 3, seed=1, step=2, epoch=0) != mini_batches(6, 3, seed=2, step=2, epoch=0)


def test_an_update_reports_its_steps_means_and_the_share_of_all_tokens_clipped() -> None:
    steps = [{"lr": 2.0, "loss": 1.0, "clipped_tokens": 1.0, "num_tokens": 10.0},
             {"lr": 1.0, "loss": 3.0, "clipped_tokens": 3.0, "num_tokens": 30.0},
             {"lr": 0.5, "loss": 2.0, "clipped_tokens": 0.0, "num_tokens": 0.0}]
    assert mean_metrics(steps) == pytest.approx({"lr": 0.5, "loss": 2.0, "clip_fraction": 4 / 40})
    # The entropy per counted token, whatever the loss aggregation made of its bonus term.
    for step, entropy_sum in zip(steps, (5.0, 15.0, 0.0), strict=True):
        step["entropy_sum"] = entropy_sum
    assert mean_metrics(steps)["entropy"] == pytest.approx(20 / 40)
