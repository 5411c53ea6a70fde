"""Training checkpoints: atomic (a temporary directory renamed into place), resumable in any layout, exportable.

Layout of ``checkpoint.dir``:
  step_000012/actor/          megarl Megatron checkpoint of the actor (tp*_pp*.safetensors + config):
                              `python -m megarl.convert mcore-to-hf --ckpt .../actor --out HF_DIR`
  step_000012/actor/optimizer/tp{T}_pp{P}_dp{D}.safetensors
                              optimizer state in the same canonical TP/PP sharding as the weights:
                              fp32 master weights ("NAME/param") and Adam moments ("NAME/exp_avg",
                              "NAME/exp_avg_sq"), each the flat range [start, start + n) of the
                              parameter that DP rank D owns (metadata "offsets": name -> [start, *shape]);
                              with the distributed optimizer every DP rank writes its own range, without
                              it DP rank 0 writes whole parameters (and, with MoE experts over EP ranks,
                              DP ranks 1..EP-1 their experts)
  step_000012/actor/optimizer/common.pt   Adam step count, LR scheduler, loss scaler
  step_000012/critic/         same for the critic (PPO)
  step_000012/rank{r}.pt      this rank's RNG states
  step_000012/trainer.json    step, data position, KL controller, layout
  latest                      name of the newest complete checkpoint (replaced atomically)
A crash while saving leaves only a ``.step_*.tmp`` directory, which is never read; the previous
checkpoint and ``latest`` stay as they were. Resuming restores weights, optimizer state, LR
schedule and data position in any TP/PP/DP layout (and with or without the distributed optimizer):
each saved parameter is merged into its HF form and split again for the new layout (see
mcore_ckpt.reshard), so the run continues as an uninterrupted run in the new layout would, up to
float rounding. The RNG states are restored only in the same layout; elsewhere the ranks keep
their fresh seeding (the RL loop draws its randomness from per-step seeds).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.config import CheckpointConfig
from megarl.errors import UserError
from megarl.models.hf_io import apply_umask, copy_model_files
from megarl.models.mcore_ckpt import FORMAT, META, VERSION, read_meta, reshard, saved_shards, shard_file
from megarl.models.spec import ModelSpec, load_spec
from megarl.models.trainable import MegatronModel

LATEST = "latest"
STOP = "STOP"
OPTIMIZER = "optimizer"
COMMON = "common.pt"
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


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


def _saving(model: MegatronModel, whole: bool) -> dict[str, torch.Tensor] | None:
    """The parameters (None: none) this rank writes: the first DP replica of a (TP, PP) position writes its
    shard, and with experts split over expert-parallel ranks the first replica of each other EP rank writes
    its experts. ``whole``: every DP rank writes (its own ranges, the distributed optimizer's way)."""
    g = model.groups
    params = model.named_params()
    if whole or g.dp_rank == 0:
        return params
    if g.dp_rank < g.dims.ep:  # DP ranks 1..ep-1 are the first replicas of the other expert-parallel ranks
        return {n: t for n, t in params.items() if ".mlp.experts." in n}
    return None


def _save_model(model: MegatronModel, out: Path) -> None:
    """The canonical shard of this (TP, PP) position, written by its first DP replica (other expert-parallel
    ranks' experts: by theirs, in files of their own)."""
    g = model.groups
    params = _saving(model, whole=False)
    if params is not None:
        tensors = {n: t.detach().cpu().contiguous() for n, t in params.items()}
        ep_rank = g.dp_rank  # 0, or the expert-parallel rank of an experts-only writer
        save_file(tensors, str(out / shard_file(g.tp_rank, g.pp_rank, ep_rank)), metadata={"format": FORMAT})
    if g.rank == 0:
        padded = model.spec.padded_vocab_size(g.dims.tp, model.opts.vocab_pad_multiple)
        (out / META).write_text(json.dumps({"format": FORMAT, "version": VERSION, "tp": g.dims.tp, "pp": g.dims.pp,
                                            "ep": g.dims.ep,
                                            "vocab_pad_multiple": model.opts.vocab_pad_multiple,
                                            "padded_vocab_size": padded, "critic": model.opts.critic}))
        copy_model_files(Path(model.hf_dir), out)  # the tokenizer and generation config: exports load as they are
        (out / "config.json").write_text(json.dumps(model.spec.hf_config, indent=2) + "\n")


def _optimizers(model: MegatronModel) -> list[Any]:
    """The Megatron optimizers of a model (several when chained, e.g. one per virtual pipeline chunk)."""
    return list(getattr(model.optimizer, "chained_optimizers", [model.optimizer]))


def _distributed(model: MegatronModel) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(opt, DistributedOptimizer) for opt in _optimizers(model))


def _slots(model: MegatronModel) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
    """Where this rank keeps each parameter's optimizer state: the offset of its part in the flattened
    parameter, and the live tensors (fp32 master weights under "param", Adam's moments and step)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megarl.models.gpt import canonical_params

    params = canonical_params(model.chunks, model.spec, model.groups)
    slots = {}
    for opt in _optimizers(model):
        for name, p in params.items():
            if isinstance(opt, DistributedOptimizer):
                # Each DP rank owns one contiguous range of every bucket, so at most one range of a parameter.
                if p in opt.model_param_group_index_map:
                    start = opt._get_model_param_range_map(p)["param"].start
                    slots[name] = (start, opt._get_main_param_and_optimizer_states(p))
                continue
            main = getattr(p, "main_param", None)
            main = p if main is None else main  # fp32 weights are their own master copy
            if main in opt.optimizer.state:
                slots[name] = (0, {"param": main, **opt.optimizer.state[main]})
    return slots


def _adam_step(model: MegatronModel) -> int:
    # torch's Adam counts steps per parameter, TE's and apex's FusedAdam per parameter group.
    inner = [opt.optimizer for opt in _optimizers(model)]
    steps = {int(g["step"]) for o in inner for g in o.param_groups if "step" in g}
    steps |= {int(s["step"]) for o in inner for s in o.state.values() if "step" in s}
    assert len(steps) == 1, steps
    return steps.pop()


def _set_adam_step(model: MegatronModel, step: int) -> None:
    for opt in _optimizers(model):
        for group in opt.optimizer.param_groups:
            if "step" in group:
                group["step"] = step
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"].fill_(step)
            elif "step" in state:
                state["step"] = step


def _allocate_optimizer_state(model: MegatronModel) -> None:
    """One zero-gradient step of the inner optimizers, so that the state tensors a checkpoint overwrites exist.

    It moves the master weights by weight decay; every one of them is then overwritten.
    """
    for opt in _optimizers(model):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        opt.optimizer.step()
        opt.optimizer.zero_grad()


def _grad_scaler(model: MegatronModel) -> Any:
    return getattr(_optimizers(model)[0], "grad_scaler", None)


def _save_optimizer(model: MegatronModel, out: Path) -> None:
    g = model.groups
    params = _saving(model, whole=_distributed(model))
    if params is not None:
        tensors, offsets = {}, {}
        for name, (start, live) in _slots(model).items():
            if name not in params:
                continue
            for key in STATE_KEYS:
                tensors[f"{name}/{key}"] = live[key].detach().reshape(-1).cpu().contiguous()
            offsets[name] = [start, *params[name].shape]
        save_file(tensors, str(out / f"tp{g.tp_rank:02d}_pp{g.pp_rank:02d}_dp{g.dp_rank:02d}.safetensors"),
                  metadata={"format": FORMAT, "tp_rank": str(g.tp_rank), "offsets": json.dumps(offsets)})
    if g.rank == 0:
        scaler = _grad_scaler(model)
        torch.save({"step": _adam_step(model), "scheduler": model.scheduler.state_dict(),
                    "grad_scaler": None if scaler is None else scaler.state_dict()}, out / COMMON)


def save(directory: str, step: int, models: dict[str, MegatronModel], trainer_state: dict[str, Any],
         keep_last: int, prepare: Callable[[str], None] | None = None) -> Path:
    """Save after ``step`` (collective: every rank calls it). ``prepare(role)`` runs before each model is
    read: it brings the model's offloaded state back to the device (megarl.offload)."""
    started = time.perf_counter()
    root = Path(directory)
    name = f"step_{step:06d}"
    tmp = root / f".{name}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for role in models:
            (tmp / role / OPTIMIZER).mkdir(parents=True)
    dist.barrier()
    try:
        for role, model in models.items():
            if prepare is not None:
                prepare(role)
            _save_model(model, tmp / role)
            _save_optimizer(model, tmp / role / OPTIMIZER)
        torch.save({"rng": _rng_state()}, tmp / f"rank{rank}.pt")
        if rank == 0:
            layout = dataclasses.asdict(next(iter(models.values())).groups.dims)
            (tmp / "trainer.json").write_text(json.dumps(trainer_state | {"step": step, "layout": layout}))
        dist.barrier()
    except BaseException:  # an interrupt or a crash abandons the checkpoint: nothing half-written stays
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        final = root / name
        shutil.rmtree(final, ignore_errors=True)
        apply_umask(tmp)
        os.replace(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / LATEST)
        done = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        print(f"megarl: saved {final} ({size / 2**20:.1f} MiB in {time.perf_counter() - started:.1f} s)", flush=True)
    dist.barrier()
    return root / name


def stop_file(cfg: CheckpointConfig) -> Path | None:
    if cfg.dir is None:
        return None
    return Path(cfg.stop_file) if cfg.stop_file is not None else Path(cfg.dir) / STOP


def stop_requested(cfg: CheckpointConfig, device: torch.device) -> bool:
    """Whether the stop file exists, as rank 0 sees it (every rank must agree: they all save)."""
    path = stop_file(cfg)
    flag = torch.tensor([dist.get_rank() == 0 and path is not None and path.exists()], dtype=torch.int32,
                        device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def acknowledge_stop(cfg: CheckpointConfig, step: int) -> None:
    """After the checkpoint of ``step``: delete the stop file so that the resumed job runs on."""
    path = stop_file(cfg)
    if dist.get_rank() == 0 and path is not None:
        path.unlink(missing_ok=True)
        print(f"megarl: stopped after step {step + 1} as {path} asked; the checkpoint resumes with "
              "checkpoint.resume: auto", flush=True)


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


def load(path: Path, models: dict[str, MegatronModel], prepare: Callable[[str], None] | None = None
         ) -> dict[str, Any]:
    """Restore weights, optimizer state and LR schedule in any layout, and the RNG states in the same one.
    ``prepare(role)`` runs before each model is written, as in ``save``."""
    state = json.loads((path / "trainer.json").read_text())
    metas = {role: _check_compatible(path / role, model) for role, model in models.items()}
    for role, model in models.items():
        if prepare is not None:
            prepare(role)
        _load_weights(path / role, metas[role], model)
        _load_optimizer(path / role, metas[role], model)
    dims = next(iter(models.values())).groups.dims
    if state.get("layout") == dataclasses.asdict(dims):
        _set_rng_state(torch.load(path / f"rank{dist.get_rank()}.pt", weights_only=False)["rng"])
    elif dist.get_rank() == 0:
        print(f"megarl: {path} was saved in layout {state.get('layout')}; weights and optimizer state were "
              "resharded", flush=True)
    return state


def _check_compatible(ckpt: Path, model: MegatronModel) -> dict[str, int]:
    """The checkpoint's meta, once it is known to hold this model's role and architecture."""
    meta = read_meta(ckpt)
    saved = load_spec(ckpt)
    for field in dataclasses.fields(ModelSpec):
        ours, theirs = getattr(model.spec, field.name), getattr(saved, field.name)
        if field.name != "hf_config" and ours != theirs:
            raise UserError(f"{ckpt} holds another model: its {field.name} is {theirs!r}, the model being trained "
                            f"(model.hf_path) has {ours!r}. Set model.hf_path to the model the checkpoint was "
                            "trained from, or checkpoint.resume to `none` or another checkpoint.")
    if bool(meta.get("critic")) != model.opts.critic:
        raise UserError(f"{ckpt / META} has critic = {bool(meta.get('critic'))}, but it is loaded into a model with "
                        f"critic = {model.opts.critic}. Point checkpoint.resume at a checkpoint of this algorithm.")
    if not (ckpt / OPTIMIZER / COMMON).is_file():
        raise UserError(f"{ckpt} has no {OPTIMIZER}/{COMMON}: it was written by an older megarl or is damaged. "
                        "Resume from another step_* directory, or set checkpoint.resume to `none`.")
    return meta


@torch.no_grad()
def _load_weights(ckpt: Path, meta: dict[str, int], model: MegatronModel) -> None:
    g = model.groups
    params = model.named_params()
    padded = model.spec.padded_vocab_size(g.dims.tp, model.opts.vocab_pad_multiple)
    for name, shard in reshard(model.spec, saved_shards(ckpt), meta, params, g.tp_rank, g.dims.tp, padded,
                               model.opts.critic):
        params[name].copy_(shard)


def _saved_state(directory: Path) -> Callable[[str], Callable[[int, str], torch.Tensor]]:
    """of(key)(tp_rank, name): the saved state ``key`` of one TP shard of a parameter, joined from its DP ranges."""
    ranges: dict[tuple[int, str], list[tuple[int, Any]]] = defaultdict(list)
    shapes: dict[tuple[int, str], list[int]] = {}
    for path in sorted(directory.glob("tp*_pp*_dp*.safetensors")):
        try:
            handle = safe_open(str(path), framework="pt")
            meta = handle.metadata()
            tp_rank, offsets = int(meta["tp_rank"]), json.loads(meta["offsets"])
        except (SafetensorError, OSError, KeyError, ValueError) as err:
            raise UserError(f"optimizer state `{path}` is unreadable ({err}). The checkpoint is damaged; resume "
                            "from another step_* directory or set checkpoint.resume to `none`.") from None
        for name, (start, *shape) in offsets.items():
            ranges[tp_rank, name].append((start, handle))
            shapes[tp_rank, name] = shape

    def of(key: str) -> Callable[[int, str], torch.Tensor]:
        def get(tp_rank: int, name: str) -> torch.Tensor:
            parts = sorted(ranges[tp_rank, name], key=lambda part: part[0])
            flat = [handle.get_tensor(f"{name}/{key}") for _, handle in parts]
            ends = [start + t.numel() for (start, _), t in zip(parts, flat, strict=True)]
            shape = shapes.get((tp_rank, name), [-1])
            if not parts or [start for start, _ in parts] != [0, *ends[:-1]] or ends[-1] != math.prod(shape):
                raise UserError(f"{directory} lacks part of the optimizer state of `{name}` (TP rank {tp_rank}). "
                                "The checkpoint is damaged; resume from another step_* directory or set "
                                "checkpoint.resume to `none`.")
            return torch.cat(flat).view(shape)

        return get

    return of


@torch.no_grad()
def _load_optimizer(ckpt: Path, meta: dict[str, int], model: MegatronModel) -> None:
    g = model.groups
    _allocate_optimizer_state(model)
    slots = _slots(model)
    padded = model.spec.padded_vocab_size(g.dims.tp, model.opts.vocab_pad_multiple)
    saved = _saved_state(ckpt / OPTIMIZER)
    for key in STATE_KEYS:
        for name, full in reshard(model.spec, saved(key), meta, slots, g.tp_rank, g.dims.tp, padded,
                                  model.opts.critic):
            start, live = slots[name]
            live[key].copy_(full.reshape(-1)[start: start + live[key].numel()].view_as(live[key]))
    common = torch.load(ckpt / OPTIMIZER / COMMON, weights_only=False)
    _set_adam_step(model, common["step"])
    model.scheduler.load_state_dict(common["scheduler"])
    if common["grad_scaler"] is not None:
        for opt in _optimizers(model):
            opt.grad_scaler.load_state_dict(common["grad_scaler"])
