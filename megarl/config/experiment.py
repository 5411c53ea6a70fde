"""The config keys that define an experiment (what a resume must not change, megarl.checkpoint.resume_check), apart from
the checks themselves so that megarl.config can validate checkpoint.allow_changes with them."""

from __future__ import annotations

import dataclasses
import functools
import re
import typing

DEFINING = ("model.hf_path", "model.dtype", "model.moe_aux_loss_coeff", "algorithm.", "data.", "trainer.seed",
            "trainer.reward", "rollout.num_samples_per_prompt", "rollout.temperature", "rollout.top_p",
            "rollout.top_k", "rollout.max_new_tokens", "rollout.max_prompt_tokens", "rollout.seed",
            "actor.optimizer.", "actor.num_ppo_epochs", "actor.mini_batch_size", "actor.lora.",
            "critic.hf_path", "critic.optimizer.", "critic.num_ppo_epochs", "critic.mini_batch_size", "agent.",
            "async_rl.", "distill.teacher", "distill.coef", "reward_model.path", "reward_model.weight",
            "reward_model.rule_weight", "reward_model.normalize", "reward_model.clip",
            "reward_model.judge.")
"""Keys (and, ending in a dot, sections) of the config that define the experiment."""
LAYOUT = ("actor.optimizer.use_distributed_optimizer", "critic.optimizer.use_distributed_optimizer",
          "agent.tool_workers", "agent.tool_wait_s", "agent.pause_at_call_end", "actor.lora.handover")
"""Inside a defining section, but only how it runs: the optimizer state reshards between the two layouts; the
number of tool calls at once, how long an engine call waits for them and pausing at call_end change which engine
call a sample's turn is in, not the distribution it draws from; a LoRA actor's hand-over gives the engine the same
policy either way."""


@functools.cache
def config_keys(cls: type, prefix: str = "") -> frozenset[str]:
    """Every dotted key of the config (its leaves)."""
    keys: set[str] = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        optional = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(optional) == 1 and dataclasses.is_dataclass(optional[0]) and len(typing.get_args(tp)) == 2:
            tp = optional[0]  # an optional section (actor.lora): its leaves when set
        keys |= (config_keys(typing.cast(type, tp), f"{prefix}{field.name}.") if dataclasses.is_dataclass(tp)
                 else {prefix + field.name})
    return frozenset(keys)


def defines_experiment(key: str, config: type) -> bool:
    """Whether dotted ``key`` is a field of the ``config`` dataclass (megarl.config.Config) that defines the
    experiment."""
    return key not in LAYOUT and key in config_keys(config) and any(
        key == d or (d.endswith(".") and key.startswith(d)) for d in DEFINING)


def allowed_changes(value: str | None) -> list[str]:
    """checkpoint.allow_changes as a list of dotted keys (commas and/or spaces between them)."""
    return [key for key in re.split(r"[,\s]+", value or "") if key]


