"""A resume with another trainer.num_steps re-sizes a decaying learning rate: lr_at follows Megatron's scheduler as
megarl builds it, and the line names both rates only when they differ."""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.schedule_change import lr_at, resized_schedule
from megarl.config.training import OptimizerConfig


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_at_is_megatrons_schedule_as_megarl_builds_it(schedule, warmup):
    import megarl.platform  # noqa: F401  (megatron-core on this machine)
    from megarl.models.trainable import lr_scheduler

    optim = OptimizerConfig(lr=1e-5, min_lr=1e-6, lr_schedule=schedule, num_warmup_steps=warmup)
    param = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([param], lr=0.0)
    sgd.param_groups[0]["is_decoupled_lr"] = False
    updates_per_step, num_steps = 4, 12
    scheduler = lr_scheduler(sgd, optim, num_steps, updates_per_step)
    for done in range(num_steps + 3):
        assert sgd.param_groups[0]["lr"] == pytest.approx(lr_at(optim, num_steps, done), rel=1e-9, abs=1e-15), done
        for _ in range(updates_per_step):
            scheduler.step(1)


def test_the_line_names_each_optimizer_whose_rate_moves_and_nothing_else():
    cosine = OptimizerConfig(lr=1e-5, lr_schedule="cosine")
    constant = OptimizerConfig(lr=1e-5)
    line = resized_schedule({"actor.optimizer": (cosine, cosine), "critic.optimizer": (constant, constant)}, 10, 20, 4)
    assert line is not None and "trainer.num_steps 10 -> 20" in line and "after 5 steps" in line
    assert "actor.optimizer.lr_schedule cosine gives 8.54e-06 where the saved run had 5e-06" in line
    assert "critic" not in line
    assert resized_schedule({"actor.optimizer": (constant, constant)}, 10, 20, 5) is None
    assert resized_schedule({"actor.optimizer": (cosine, cosine)}, 20, 20, 5) is None
    assert resized_schedule({"actor.optimizer": (cosine, cosine)}, None, 20, 4) is None  # a checkpoint without a config
    assert resized_schedule({"actor.optimizer": (cosine, cosine)}, 10, 20, None) is None  # nor its step


def test_the_saved_runs_rate_comes_from_the_saved_optimizer_settings():
    """With actor.optimizer.lr also changed (checkpoint.allow_changes), "the saved run had" is the saved lr's curve."""
    from megarl.checkpoint.schedule_change import saved_optimizer

    now = OptimizerConfig(lr=2e-5, lr_schedule="cosine")
    saved = saved_optimizer({"actor.optimizer.lr": 1e-5, "actor.optimizer.lr_schedule": "cosine"}, "actor.optimizer",
                            now)
    assert saved.lr == 1e-5 and now.lr == 2e-5
    line = resized_schedule({"actor.optimizer": (saved, now)}, 10, 20, 4)
    assert line is not None and "gives 1.71e-05 where the saved run had 5e-06" in line
    assert saved_optimizer({"actor.optimizer.lr": "oops"}, "actor.optimizer", now) is now  # unreadable: as now
