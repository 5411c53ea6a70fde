"""Training checkpoints: atomic (a temporary directory renamed into place), resumable, exportable.

Layout of ``checkpoint.dir``:
  step_000012/actor/          megarl Megatron checkpoint of the actor (tp*_pp*.safetensors + config):
                              `python -m megarl.convert mcore-to-hf --ckpt .../actor --out HF_DIR`
  step_000012/critic/         same for the critic (PPO)
  step_000012/rank{r}.pt      this rank's optimizer, LR scheduler and RNG states
  step_000012/trainer.json    step, data position, KL controller, layout
  latest                      name of the newest complete checkpoint (replaced atomically)
A crash while saving leaves only a ``.step_*.tmp`` directory, which is never read; the previous
checkpoint and ``latest`` stay as they were. Resuming in the same layout restores everything;
in another TP/PP layout the weights are resharded from the canonical shards and the optimizer
starts fresh (with a warning), since Megatron's optimizer state is laid out per shard.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.errors import UserError
from megarl.models.mcore_ckpt import FORMAT, META, VERSION, open_mcore, read_meta, shard_file
from megarl.models.trainable import MegatronModel

LATEST = "latest"


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _save_model(model: MegatronModel, out: Path) -> None:
    """The canonical shard of this (TP, PP) position, written by its first DP replica."""
    g = model.groups
    if g.dp_rank == 0:
        tensors = {n: t.detach().cpu().contiguous() for n, t in model.named_params().items()}
        save_file(tensors, str(out / shard_file(g.tp_rank, g.pp_rank)), metadata={"format": FORMAT})
    if g.rank == 0:
        padded = model.spec.padded_vocab_size(g.dims.tp, model.opts.vocab_pad_multiple)
        (out / META).write_text(json.dumps({"format": FORMAT, "version": VERSION, "tp": g.dims.tp, "pp": g.dims.pp,
                                            "vocab_pad_multiple": model.opts.vocab_pad_multiple,
                                            "padded_vocab_size": padded, "critic": model.opts.critic}))
        (out / "config.json").write_text(json.dumps(model.spec.hf_config, indent=2) + "\n")


def _main_params(model: MegatronModel) -> list[torch.Tensor]:
    """The fp32 master copies Megatron keeps beside bf16/fp16 weights (empty for fp32 weights)."""
    opt = model.optimizer
    groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", [])
    return [p for group in groups for p in group]


def _optimizer_state(model: MegatronModel) -> dict[str, Any]:
    # The inner torch optimizer's own state (Adam moments and steps, by parameter index) plus the
    # master weights: both are laid out identically when the run resumes in the same layout.
    return {"inner": model.optimizer.optimizer.state_dict(), "scheduler": model.scheduler.state_dict(),
            "main_params": [p.detach().cpu().clone() for p in _main_params(model)]}


def _load_optimizer_state(model: MegatronModel, state: dict[str, Any]) -> None:
    model.optimizer.optimizer.load_state_dict(state["inner"])
    with torch.no_grad():
        for live, saved in zip(_main_params(model), state["main_params"], strict=True):
            live.copy_(saved)
    model.scheduler.load_state_dict(state["scheduler"])


def save(directory: str, step: int, models: dict[str, MegatronModel], trainer_state: dict[str, Any],
         keep_last: int) -> Path:
    """Save after ``step`` (collective: every rank calls it)."""
    root = Path(directory)
    name = f"step_{step:06d}"
    tmp = root / f".{name}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for role in models:
            (tmp / role).mkdir(parents=True)
    dist.barrier()
    for role, model in models.items():
        _save_model(model, tmp / role)
    torch.save({"rng": _rng_state(), **{role: _optimizer_state(m) for role, m in models.items()}},
               tmp / f"rank{rank}.pt")
    if rank == 0:
        world = dist.get_world_size()
        (tmp / "trainer.json").write_text(json.dumps(trainer_state | {"step": step, "world_size": world}))
    dist.barrier()
    if rank == 0:
        final = root / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / LATEST)
        done = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return root / name


def find(resume: str, directory: str | None) -> Path | None:
    """The checkpoint to resume from: ``auto`` = the newest complete one in ``directory`` (or none)."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "trainer.json").is_file():
            raise UserError(f"checkpoint.resume = {resume!r} is not a complete megarl checkpoint (no trainer.json). "
                            "Pass a step_* directory, `auto` or `none`.")
        return path
    if directory is None or not (Path(directory) / LATEST).is_file():
        return None
    path = Path(directory) / (Path(directory) / LATEST).read_text().strip()
    if not (path / "trainer.json").is_file():
        raise UserError(f"{Path(directory) / LATEST} names {path.name}, which is incomplete or missing. Set "
                        "checkpoint.resume to an existing step_* directory or `none`.")
    return path


def load(path: Path, models: dict[str, MegatronModel]) -> dict[str, Any]:
    """Restore weights (any layout), and optimizer/scheduler/RNG state when the layout is the same."""
    state = json.loads((path / "trainer.json").read_text())
    rank = dist.get_rank()
    same_layout = True
    for role, model in models.items():
        meta = read_meta(path / role)
        g = model.groups
        same_layout &= (meta["tp"], meta["pp"]) == (g.dims.tp, g.dims.pp) and state["world_size"] == g.dims.world_size
        _load_weights(path / role, model)
    if same_layout:
        saved = torch.load(path / f"rank{rank}.pt", weights_only=False)
        for role, model in models.items():
            _load_optimizer_state(model, saved[role])
        _set_rng_state(saved["rng"])
    elif rank == 0:
        print(f"megarl: {path} was saved in another layout; weights were resharded, the optimizer starts fresh.",
              flush=True)
    return state


@torch.no_grad()
def _load_weights(ckpt: Path, model: MegatronModel) -> None:
    g = model.groups
    meta = read_meta(ckpt)
    params = model.named_params()
    if (meta["tp"], meta["pp"]) == (g.dims.tp, g.dims.pp):
        from safetensors.torch import load_file

        shard = load_file(str(ckpt / shard_file(g.tp_rank, g.pp_rank)))
        for name, param in params.items():
            param.copy_(shard[name])
        return
    if model.opts.critic:
        raise UserError(f"{ckpt}: the critic can only be resumed in the TP/PP layout it was saved in "
                        f"(TP={meta['tp']} PP={meta['pp']}); its value head has no HF form to reshard through.")
    from megarl.models.gpt import load_weights

    spec, tensors = open_mcore(ckpt)
    full = dict(tensors)

    def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        return full[name] if dim is None else full[name].narrow(dim, start, stop - start)

    load_weights(model.chunks, spec, read, g, model.opts)
