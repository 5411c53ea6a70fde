"""A resume continues the experiment its checkpoint was saved by: the fields that define it (model, dtype,
algorithm, reward, data, sampling, batch shape, optimizer, seeds) must equal the checkpoint's, unless
``checkpoint.allow_changes`` lists them. The layout (parallel.*, the distributed optimizer, micro-batching,
offloading, the engine's settings) and trainer.num_steps may change freely: the checkpoint reshards on load,
and a longer run is the same experiment continued (a decaying learning rate is re-sized to it, which one line says:
schedule_change.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.checkpoint import manifest
from megarl.checkpoint.schedule_change import resized_schedule, saved_optimizer
from megarl.config import Config
from megarl.config.experiment import allowed_changes, defines_experiment
from megarl.distributed.rank0 import from_rank0
from megarl.errors import UserError


def experiment(flat: dict[str, Any]) -> dict[str, Any]:
    """The defining fields of a flattened config (the critic's only when it trains one), as JSON values."""
    ppo = flat.get("algorithm.name") == "ppo"
    return {k: json.loads(json.dumps(v)) for k, v in flat.items()
            if defines_experiment(k, Config) and (ppo or not k.startswith("critic."))}


def changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) of each defining field that differs. A key only one side has (a
    field added or removed by another megarl version) is not a change of the experiment."""
    old, new = experiment(saved), experiment(current)
    return [(k, old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]]


def section_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(section, saved fields or None, current fields or None) of each optional section (actor.lora,
    reward_model.judge) set on one side and null on the other. The two flatten to the section's fields on one side
    and one null key on the other: they share no key, so ``changes`` cannot see it."""
    old, new = experiment(saved), experiment(current)

    def fields(flat: dict[str, Any], section: str) -> dict[str, Any] | None:
        return {k[len(section) + 1:]: v for k, v in flat.items() if k.startswith(section + ".")} or None

    nulls = sorted({k for flat in (saved, current) for k, v in flat.items() if v is None})
    return [(k, fields(old, k), fields(new, k)) for k in nulls if (fields(old, k) is None) != (fields(new, k) is None)]


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def check_unchanged(cfg: Config, path: Path, rank: int) -> dict[str, Any]:
    """Refuse to resume ``path`` under a config that defines another experiment (every rank alike); else its
    trainer.json."""
    if cfg.algorithm.name == "ppo" and not (path / "critic").is_dir():
        raise UserError(f"checkpoint {path} holds no critic (it was saved by a grpo run), but algorithm.name = "
                        "ppo trains one: algorithm grpo -> ppo cannot resume. Fix: set algorithm.name: grpo to "
                        "continue that run, or another checkpoint.dir to start a "
                        "ppo run.")
    state = json.loads((path / "trainer.json").read_text())
    allowed = set(allowed_changes(cfg.checkpoint.allow_changes))
    check_teacher_unchanged(cfg, state.get("teacher"), path, allowed, rank)
    if cfg.algorithm.kl_coef > 0:  # the KL's reference is built from model.hf_path again: the same weights
        check_weights_unchanged("model.hf_path", cfg.model.hf_path, state.get("reference"), path, allowed, rank,
                                "KL reference", "was held to")
    check_reward_model_unchanged(cfg, (state.get("reward_model") or {}).get("files"), path, allowed, rank)
    saved = state.get("config")
    if saved is None:
        if rank == 0:
            print(f"megarl: {path} holds no config (saved by a megarl before resumes compared them): the "
                  "experiment is not checked against it", flush=True)
        return state
    current = cfg.to_flat_dict()
    toggled = section_changes(saved, current)
    for section, before, after in toggled:
        if section == "actor.lora":  # the checkpoint's state is the adapters' (or the whole model's) alone
            raise UserError(
                f"checkpoint {path} was saved with actor.lora {_show(before)}, and this config sets actor.lora: "
                f"{_show(after)}: a LoRA run's checkpoint holds the adapters and their optimizer's state, a full "
                "fine-tuning run's the whole model's, so neither resumes as the other. Fix: set actor.lora back to "
                "the checkpoint's; to fine-tune every weight from a LoRA checkpoint, export it merged (python -m "
                f"megarl.convert mcore-to-hf --ckpt {path / 'actor'} --out DIR --merge) and start a new run from "
                "DIR (model.hf_path) in another checkpoint.dir.")
        if not any(k.startswith(section + ".") for k in allowed):  # e.g. a judge, which holds no state
            raise UserError(
                f"checkpoint {path} was saved with {section} {_show(before)}, and this config sets {section}: "
                f"{_show(after)}: a resume continues the run it was saved by. Fix: set {section} back to the "
                "checkpoint's; or, to continue with the change deliberately, list its fields in "
                f"checkpoint.allow_changes (e.g. {section}.{next(iter(before or after))}); or set "
                "another checkpoint.dir with checkpoint.resume: none to start a new run.")
    found = changes(saved, current)
    refused = [(k, a, b) for k, a, b in found if k not in allowed]
    if refused:
        listed = "; ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in refused)
        keys = ",".join(k for k, _, _ in refused)
        raise UserError(f"checkpoint {path} was saved by another experiment: {listed}. A resume continues the run "
                        "it was saved by (and its mlflow params would describe it wrongly). Fix: set these back to "
                        "the checkpoint's values; or, to continue with the change deliberately, list them in "
                        f"checkpoint.allow_changes (--set checkpoint.allow_changes={keys}); or set "
                        "another checkpoint.dir with checkpoint.resume: none to start a new run.")
    optimizers = {"actor.optimizer": cfg.actor.optimizer} | (
        {"critic.optimizer": cfg.critic.optimizer} if cfg.algorithm.name == "ppo" else {})
    schedules = {name: (saved_optimizer(saved, name, o), o) for name, o in optimizers.items()}
    resized = resized_schedule(schedules, saved.get("trainer.num_steps"), cfg.trainer.num_steps, state.get("step"))
    if resized and rank == 0:
        print(resized, flush=True)
    if (found or toggled) and rank == 0:
        print(f"megarl: resuming {path} with "
              + ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in found + toggled)
              + " (checkpoint.allow_changes); the resumed mlflow run keeps the params it started with", flush=True)
    return state


def check_teacher_unchanged(cfg: Config, saved: dict[str, Any] | None, path: Path, allowed: set[str],
                            rank: int = 0) -> None:
    """A distillation run resumes only with the teacher it learned from (``check_weights_unchanged``); a 70B
    teacher is 140 GB to read, which rank 0 alone does."""
    check_weights_unchanged("distill.teacher", cfg.distill.teacher, saved, path, allowed, rank, "teacher",
                            "learned from")


def check_reward_model_unchanged(cfg: Config, saved: dict[str, Any] | None, path: Path, allowed: set[str],
                                 rank: int = 0) -> None:
    """A run with a reward model resumes only with the reward model it was trained against
    (``check_weights_unchanged``)."""
    check_weights_unchanged("reward_model.path", cfg.reward_model.path, saved, path, allowed, rank, "reward model",
                            "was trained against")


def check_weights_unchanged(field: str, current: str | None, saved: dict[str, Any] | None, path: Path,
                            allowed: set[str], rank: int, role: str, verb: str) -> None:
    """A frozen model's weight files (size and CRC-32) as the checkpoint recorded them (``saved``: their path and
    files), against those at ``field`` now, wherever they live (the same path may hold other weights). Rank 0 reads
    the files, as it recorded them at the start, and every rank refuses alike; ``checkpoint.allow_changes`` naming
    ``field`` lets it pass."""
    if current is None or not saved or field in allowed:
        return
    differ = from_rank0(lambda: manifest.files_differ(saved["files"], current), rank)
    if differ:
        raise UserError(f"checkpoint {path} {verb} the {role} at {saved.get('path')}, whose weight files differ from "
                        f"{field} = {current} ({differ[:3]}: size or CRC-32). Another {role} is another experiment. "
                        f"Fix: point {field} at the {role} the run started with; or, to continue with this one "
                        f"deliberately, --set checkpoint.allow_changes={field}; or another checkpoint.dir to start a "
                        "new run.")
