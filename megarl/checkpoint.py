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
  step_000012/actor/lora/rank{r}.safetensors
                              a LoRA actor's (actor.lora) adapters and their optimizer state, as rank r holds
                              them (resumable in any layout, megarl.lora.shards); the actor's weights beside them are
                              the merged W + s B A, its base weights come from model.hf_path again
  step_000012/actor/lora/base_model.json
                              the base model's path and the size and CRC-32 of its weight files: a resume onto
                              other base weights is refused
  step_000012/critic/         same for the critic (PPO)
  step_000012/rank{r}.pt      this rank's RNG states
  step_000012/trainer.json    step, data position, KL controller, layout, the run's flattened config
  step_000012/manifest.json   size and CRC-32 of every other file (megarl.manifest)
  latest                      name of the newest complete checkpoint (replaced atomically)
  step_000005.damaged/        a checkpoint that failed verification, set aside by ``resume: auto``
A crash while saving leaves only a ``.step_*.tmp`` directory, which is never read; the previous
checkpoint and ``latest`` stay as they were. Every file is fsynced, then checksummed, and the directories
are fsynced before the rename. A resume first verifies the checkpoint (``verify``: each rank checks its
share of the bytes) and compares the experiment (megarl.resume_check). Resuming restores weights, optimizer state, LR
schedule and data position in any TP/PP/DP layout (and with or without the distributed optimizer):
each saved parameter is merged into its HF form and split again for the new layout (see
mcore_ckpt.reshard), so the run continues as an uninterrupted run in the new layout would, up to
float rounding. The RNG states are restored only in the same layout; elsewhere the ranks keep
their fresh seeding (the RL loop draws its randomness from per-step seeds).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
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

from megarl import manifest
from megarl.config import CheckpointConfig
from megarl.errors import UserError
from megarl.keep_best import best_step
from megarl.lora import shards as lora_shards
from megarl.lora.saved import BASE_MODEL, LORA_DIR, SavedAdapters, adapter_files
from megarl.models.hf_io import apply_umask, copy_model_files
from megarl.models.mapping import param_rules
from megarl.models.mcore_ckpt import FORMAT, META, VERSION, read_meta, reshard, saved_shards, shard_file
from megarl.models.spec import ModelSpec, load_spec
from megarl.models.trainable import MegatronModel

LATEST = "latest"
STOP = "STOP"
OPTIMIZER = "optimizer"
COMMON = "common.pt"
TRAINER = "trainer.json"
STEP_DIR = re.compile(r"step_(\d{6,})")
FULL_BELOW = 64 * 2**20
"""A save that fails with less free space than this in checkpoint.dir failed for the lack of it."""
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


def _save_model(model: MegatronModel, out: Path) -> list[Path]:
    """The canonical shard of this (TP, PP) position, written by its first DP replica (other expert-parallel
    ranks' experts: by theirs, in files of their own); the shard file written (rank 0's other files: unnamed)."""
    g = model.groups
    if getattr(model, "lora", None) is not None:
        model.refresh_merged()  # a LoRA actor writes its current merged weights, not the last hand-over's
    params = _saving(model, whole=False)
    written = []
    if params is not None:
        tensors = {n: t.detach().cpu().contiguous() for n, t in params.items()}
        ep_rank = g.dp_rank  # 0, or the expert-parallel rank of an experts-only writer
        written.append(out / shard_file(g.tp_rank, g.pp_rank, ep_rank))
        save_file(tensors, str(written[-1]), metadata={"format": FORMAT})
    if g.rank == 0:
        padded = model.spec.padded_vocab_size(g.dims.tp, model.opts.vocab_pad_multiple)
        (out / META).write_text(json.dumps({"format": FORMAT, "version": VERSION, "tp": g.dims.tp, "pp": g.dims.pp,
                                            "ep": g.dims.ep,
                                            "vocab_pad_multiple": model.opts.vocab_pad_multiple,
                                            "padded_vocab_size": padded, "critic": model.opts.critic}))
        if model.hf_dir is not None:  # the tokenizer and generation config: exports load as they are
            copy_model_files(Path(model.hf_dir), out)
        (out / "config.json").write_text(json.dumps(model.spec.hf_config, indent=2) + "\n")
    return written


def _optimizers(model: MegatronModel) -> list[Any]:
    """The Megatron optimizers of a model (several when chained, e.g. one per virtual pipeline chunk)."""
    return list(getattr(model.optimizer, "chained_optimizers", [model.optimizer]))


def _distributed(model: MegatronModel) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(opt, DistributedOptimizer) for opt in _optimizers(model))


def _slots(model: MegatronModel, params: dict[str, torch.nn.Parameter] | None = None
           ) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
    """Where this rank keeps each parameter's optimizer state: the offset of its part in the flattened
    parameter, and the live tensors (fp32 master weights under "param", Adam's moments and step). ``params``: by
    name, the parameters to look up (the canonical ones if None)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megarl.models.gpt import canonical_params

    if params is None:
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


def _save_optimizer(model: MegatronModel, out: Path) -> list[Path]:
    g = model.groups
    params = _saving(model, whole=_distributed(model))
    written = []
    if params is not None:
        tensors, offsets = {}, {}
        for name, (start, live) in _slots(model).items():
            if name not in params:
                continue
            for key in STATE_KEYS:
                tensors[f"{name}/{key}"] = live[key].detach().reshape(-1).cpu().contiguous()
            offsets[name] = [start, *params[name].shape]
        written.append(out / f"tp{g.tp_rank:02d}_pp{g.pp_rank:02d}_dp{g.dp_rank:02d}.safetensors")
        save_file(tensors, str(written[-1]),
                  metadata={"format": FORMAT, "tp_rank": str(g.tp_rank), "offsets": json.dumps(offsets)})
    if g.rank == 0:
        scaler = _grad_scaler(model)
        torch.save({"step": _adam_step(model), "scheduler": model.scheduler.state_dict(),
                    "grad_scaler": None if scaler is None else scaler.state_dict()}, out / COMMON)
    return written


def save(directory: str, step: int, models: dict[str, MegatronModel], trainer_state: dict[str, Any],
         keep_last: int, prepare: Callable[[str], None] | None = None) -> Path:
    """Save after ``step`` (collective: every rank calls it). ``prepare(role)`` runs before each model is
    read: it brings the model's offloaded state back to the device (megarl.offload). Every rank fsyncs and
    checksums the files it wrote; rank 0 writes the manifest, fsyncs the directories, renames the checkpoint
    into place, points ``latest`` at it and rotates."""
    started = time.perf_counter()
    root = Path(directory)
    name = f"step_{step:06d}"
    tmp = root / f".{name}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for role, model in models.items():
            (tmp / role / OPTIMIZER).mkdir(parents=True)
            if getattr(model, "lora", None) is not None:
                (tmp / role / LORA_DIR).mkdir()
    dist.barrier()
    error: BaseException | None = None
    files: dict[str, dict[str, Any]] = {}
    try:
        written = [tmp / f"rank{rank}.pt"]
        for role, model in models.items():
            if prepare is not None:
                prepare(role)
            written += _save_model(model, tmp / role)
            written += _save_optimizer(model, tmp / role / OPTIMIZER)
            written += _save_adapters(model, tmp / role)
        torch.save({"rng": _rng_state()}, written[0])
        if rank == 0:
            layout = dataclasses.asdict(next(iter(models.values())).groups.dims)
            (tmp / TRAINER).write_text(json.dumps(trainer_state | {"step": step, "layout": layout}))
        files = manifest.describe(tmp, [p for p in written if p.exists()])
    except Exception as err:  # noqa: BLE001 (every rank learns of it below, so that none waits for the others)
        error = err
    except BaseException:  # an interrupt abandons the checkpoint: nothing half-written stays
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (_describe_error(error, root), files))
    failed = [(r, e) for r, (e, _) in enumerate(reports) if e is not None]
    published: list[Any] = [None]  # rank 0's failure to publish, if any
    if rank == 0:
        if not failed:
            try:
                _publish(root, tmp, name, {k: v for _, f in reports for k, v in f.items()}, keep_last)
            except Exception as err:  # noqa: BLE001
                error, published[0] = err, _describe_error(err, root)
            except BaseException:  # interrupted before the rename: nothing half-written stays
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        if failed or published[0] is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.broadcast_object_list(published, src=0)
    if published[0] is not None:
        failed.append((0, published[0]))
    if failed:
        full = [(r, detail) for r, (disk_full, detail) in failed if disk_full]
        if full:
            raise UserError(_disk_full(root, name, *full[0])) from None
        if error is not None:
            raise error
        raise RuntimeError(f"rank {failed[0][0]} failed while saving checkpoint {name} ({failed[0][1][1]}); the "
                           f"partial {tmp} was removed")
    if rank == 0:
        final = root / name
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        print(f"megarl: saved {final} ({size / 2**20:.1f} MiB in {time.perf_counter() - started:.1f} s)", flush=True)
    return root / name


def _describe_error(err: BaseException | None, where: Path) -> tuple[bool, str] | None:
    """What every rank needs to know of another's failure (exceptions do not travel between processes): whether
    the file system of ``where`` is full, and what failed. safetensors and torch.save do not raise OSError: the
    first names the OS error in its message, the second only an "unexpected pos", hence the look at the space."""
    if err is None:
        return None
    text = " ".join(str(err).split())
    full = (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        marker in text for marker in ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122"))
    if not full:
        try:
            full = shutil.disk_usage(where).free < FULL_BELOW
        except OSError:
            pass
    return full, f"{type(err).__name__}: {text[:300]}"


def _disk_full(root: Path, name: str, rank: int, detail: str) -> str:
    usage = shutil.disk_usage(root)
    found = checkpoints(root)
    last = found[max(found)] if found else None
    need = (f"; the last checkpoint, {last.name}, took {_size(sum(f.stat().st_size for f in last.rglob('*')))}"
            if last is not None else "")
    return (f"checkpoint.dir = {str(root)!r} is full: saving {name} failed on rank {rank} ({detail}). "
            f"{_size(usage.free)} of {_size(usage.total)} are free there now{need}. The partial .{name}.tmp was "
            "removed; the earlier checkpoints and `latest` are as they were. Fix: free space in "
            f"{root} (or point checkpoint.dir at a larger file system, or lower checkpoint.keep_last) and "
            "resume with checkpoint.resume: auto.")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _publish(root: Path, tmp: Path, name: str, files: dict[str, dict[str, Any]], keep_last: int) -> None:
    """Rank 0, once every rank's files are durable: the files it wrote unnamed (the model's HF files), the
    manifest, the directories' entries, the rename, ``latest``, then the rotation."""
    listed = {p for p in tmp.rglob("*") if p.is_file()}
    files |= manifest.describe(tmp, [p for p in listed if p.relative_to(tmp).as_posix() not in files])
    manifest.write(tmp, files)
    apply_umask(tmp)
    for folder in sorted({p.parent for p in listed} | {tmp}, key=lambda p: -len(p.parts)):
        manifest.fsync_dir(folder)
    final = root / name
    if final.exists():  # the same step saved again (a resumed run): the old one goes only once the new one is in
        old = root / f".{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    manifest.fsync_dir(root)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name)
    manifest.fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    manifest.fsync_dir(root)
    rotate(root, keep_last, final)


def checkpoints(root: Path) -> dict[int, Path]:
    """The complete checkpoints in ``root`` by step (never a .tmp or .damaged one)."""
    found = {}
    for path in root.glob("step_*"):
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return found


def rotate(root: Path, keep_last: int, saved: Path) -> None:
    """Keep ``saved`` (just written and checksummed from the disk: the newest verified checkpoint), the
    ``keep_last - 1`` newest before it and the best one (checkpoint.keep_best); delete older ones. Checkpoints
    of later steps (left by a run resumed from an earlier one) are not this run's to delete."""
    step, best = int(saved.name.removeprefix("step_")), best_step(root)
    older = sorted((s for s in checkpoints(root) if s < step), reverse=True)
    for s in [s for s in older[keep_last - 1:] if s != best]:  # checkpoint.keep_best's stays
        shutil.rmtree(root / f"step_{s:06d}", ignore_errors=True)


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
    """The checkpoint to resume from, verified (collective: see ``verify``). ``auto``: the newest in
    ``directory`` that verifies; damaged ones are passed over with one line and renamed *.damaged, so that
    neither a later resume nor the rotation counts them. A named checkpoint that does not verify is an error."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / TRAINER).is_file():
            raise UserError(f"checkpoint.resume = {resume!r} is not a complete megarl checkpoint (no {TRAINER}). "
                            "Pass a step_* directory, `auto` or `none`.")
        problem = verify(path)
        if problem is not None:
            raise UserError(f"checkpoint.resume = {resume!r} is damaged: {problem}. Nothing was loaded from it. "
                            "Fix: name an earlier step_* directory, or set checkpoint.resume: auto (the newest "
                            "checkpoint in checkpoint.dir that verifies), or none to start fresh.")
        return path
    if directory is None:
        return None
    root = Path(directory)
    damaged: list[tuple[Path, str]] = []
    for path in _candidates(root):
        problem = verify(path) if (path / TRAINER).is_file() else f"{path} is missing or incomplete (no {TRAINER})"
        if problem is None:
            if damaged and dist.get_rank() == 0:
                kept = ", ".join(f"{p.name} ({why}; kept as {_quarantine(p)})" for p, why in damaged)
                print(f"megarl: resuming from {path.name}, the newest checkpoint in {root} that verifies, instead "
                      f"of the damaged {kept}", flush=True)
            return path
        damaged.append((path, problem))
    if damaged:
        raise UserError(f"checkpoint.resume = 'auto' found no checkpoint in {root} that verifies: "
                        + "; ".join(f"{p.name}: {why}" for p, why in damaged)
                        + ". Nothing was loaded, deleted or renamed. Fix: restore a good copy of one of them, or set "
                        "checkpoint.resume: none (or another checkpoint.dir) to start fresh.")
    return None


def _candidates(root: Path) -> list[Path]:
    """Where ``auto`` looks, in order: the checkpoint ``latest`` names, then the earlier ones, newest first.
    Later ones than ``latest`` belong to a run that was resumed from an earlier checkpoint: not this one's."""
    found = checkpoints(root)
    if not (root / LATEST).is_file():
        return [found[s] for s in sorted(found, reverse=True)]
    named = root / (root / LATEST).read_text().strip()
    match = STEP_DIR.fullmatch(named.name)
    below = int(match.group(1)) if match else math.inf  # a damaged pointer: every checkpoint is a candidate
    return [named] + [found[s] for s in sorted(found, reverse=True) if s < below and found[s] != named]


def _quarantine(path: Path) -> str:
    if not path.exists():
        return "nothing: it is missing"
    target = path.with_name(path.name + ".damaged")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged{n}")
    os.replace(path, target)
    return target.name


def verify(path: Path) -> str | None:
    """What is wrong with checkpoint ``path``, or None: every file against the manifest's size and checksum
    (each rank checks its share of the bytes, so the time is the slowest rank's share), and the small files
    every rank reads (trainer.json, common.pt, its rank*.pt) load. Collective: every rank returns the same.
    A checkpoint of a megarl before manifests is accepted with a line saying that it is not verified."""
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    found: list[str] = []
    try:
        files = manifest.read(path)
    except manifest.ManifestError as err:
        files, found = {}, [str(err)]
    if files is None:
        if rank == 0:
            print(f"megarl: {path} has no {manifest.MANIFEST} (saved by a megarl before checksums): its files are "
                  "not verified", flush=True)
    else:
        found += manifest.problems(path, files, manifest.share(files, rank, world))
    if not found:
        found += _unloadable(path, rank)
    everything: list[Any] = [None] * world
    dist.all_gather_object(everything, found)
    problem = next((p for part in everything for p in part), None)
    if problem is None and files and rank == 0:
        gib = sum(f["bytes"] for f in files.values()) / 2**30
        print(f"megarl: verified {path} ({len(files)} files, {gib:.2f} GiB checksummed over {world} ranks in "
              f"{time.perf_counter() - started:.1f} s)", flush=True)
    return problem


def _unloadable(path: Path, rank: int) -> list[str]:
    """The small files every rank reads, loaded as a resume loads them: damage to one is an error every rank
    reports alike (a checkpoint without a manifest gets no other check)."""
    def unreadable(file: Path, err: BaseException) -> list[str]:
        return [f"{file} is unreadable ({type(err).__name__}: {' '.join(str(err).split())[:200]})"]

    try:
        int(json.loads((path / TRAINER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return unreadable(path / TRAINER, err)
    for file in [*sorted(path.glob(f"*/{OPTIMIZER}/{COMMON}")), path / f"rank{rank}.pt"]:
        if file.name != COMMON and not file.exists():  # another layout's ranks: not read
            continue
        try:
            torch.load(file, weights_only=False)
        except Exception as err:  # noqa: BLE001 (a damaged pickle fails in any of a dozen ways)
            return unreadable(file, err)
    return []


def load(path: Path, models: dict[str, MegatronModel], prepare: Callable[[str], None] | None = None
         ) -> dict[str, Any]:
    """Restore weights, optimizer state and LR schedule in any layout, and the RNG states in the same one.
    ``prepare(role)`` runs before each model is written, as in ``save``."""
    state = json.loads((path / TRAINER).read_text())
    metas = {role: _check_compatible(path / role, model) for role, model in models.items()}
    for role, model in models.items():
        if prepare is not None:
            prepare(role)
        _load_weights(path / role, metas[role], model)
        _load_optimizer(path / role, metas[role], model)
        _load_adapters(path / role, model)
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


def _saved_state(directory: Path, files: str = "tp*_pp*_dp*.safetensors"
                 ) -> Callable[[str], Callable[[int, str], torch.Tensor]]:
    """of(key)(tp_rank, name): the saved state ``key`` of one TP shard of a parameter, joined from its DP ranges
    (the ``files`` of ``directory``: the optimizer's, or a LoRA actor's rank files)."""
    ranges: dict[tuple[int, str], list[tuple[int, Any]]] = defaultdict(list)
    shapes: dict[tuple[int, str], list[int]] = {}
    for path in sorted(directory.glob(files)):
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


def _adapter_file(directory: Path, rank: int) -> Path:
    return directory / f"{LORA_DIR}/rank{rank:04d}.safetensors"


def _save_adapters(model: MegatronModel, out: Path) -> list[Path]:
    """A LoRA actor (actor.lora): every rank writes its adapters (this rank's shards, by chunk and module name) and
    their optimizer state (its own range of them with the distributed optimizer) to lora/rank{r}.safetensors. The
    model's weights written beside them are the merged W + s B A (an export of the adapted model); its base weights
    come from model.hf_path again on resume."""
    lora = getattr(model, "lora", None)
    if lora is None:
        return []
    params = model.adapter_params()
    tensors = {name: p.detach().cpu().contiguous() for name, p in params.items()}
    offsets = {}
    g = model.groups
    # As _save_optimizer: each DP rank its range with the distributed optimizer, else DP rank 0 the whole state.
    slots = _slots(model, params) if _distributed(model) or g.dp_rank == 0 else {}
    for name, (start, live) in slots.items():
        for key in STATE_KEYS:
            # a copy: in float32 the master weights are the parameters, which one file cannot hold twice
            tensors[f"{name}/{key}"] = live[key].detach().reshape(-1).cpu().clone()
        offsets[name] = [start, *params[name].shape]
    path = _adapter_file(out, dist.get_rank())
    written = [path]
    if dist.get_rank() == 0:
        written.append(out / LORA_DIR / BASE_MODEL)
        written[-1].write_text(json.dumps(base_model(model.hf_dir), indent=1) + "\n")
    save_file(tensors, str(path), metadata={
        "format": FORMAT, "offsets": json.dumps(offsets), "tp_rank": str(g.tp_rank), "tp": str(g.dims.tp),
        "dp_rank": str(g.dp_rank), "lora": json.dumps(dataclasses.asdict(lora))})
    return written


@torch.no_grad()
def _load_adapters(ckpt: Path, model: MegatronModel) -> None:
    """Restore a LoRA actor's adapters and their optimizer state (after ``_load_optimizer`` made the state), in any
    layout: each factor's TP shards (its state's joined from the DP ranges that held them) are joined and split
    again as its base weight's are (megarl.lora.shards), a pure copy in the layout they were saved in."""
    lora = getattr(model, "lora", None)
    if lora is None:
        return
    files = adapter_files(ckpt)
    if not files:
        raise UserError(f"{ckpt} holds no LoRA adapters ({LORA_DIR}/ is missing): it was saved without actor.lora. "
                        "Resume it without actor.lora, or set checkpoint.resume to `none`.")
    _check_base_model(ckpt / LORA_DIR / BASE_MODEL, model.hf_dir)
    saved = SavedAdapters(files)
    theirs = {k: saved.lora.get(k) for k in ("rank", "target_modules")}
    ours = {"rank": lora.rank, "target_modules": list(lora.target_modules)}
    if theirs != ours:
        raise UserError(f"{ckpt} holds adapters of actor.lora {theirs}, this actor has {ours}. Resume with the "
                        "checkpoint's actor.lora, or set checkpoint.resume to `none`.")
    g = model.groups
    rules = {r.mcore: r for r in param_rules(model.spec, include_output=False)}
    params = model.adapter_params()
    slots = _slots(model, params)
    state = _saved_state(ckpt / LORA_DIR, "rank*.safetensors")
    for name, p in params.items():
        rule = rules[lora_shards.base_weight(name)]
        p.copy_(lora_shards.reshard_factor(model.spec, rule, name, saved.factor(name), g.tp_rank, g.dims.tp))
        if name in slots:
            start, live = slots[name]
            for key in STATE_KEYS:
                shards = [state(key)(t, name) for t in range(saved.tp)]
                full = lora_shards.reshard_factor(model.spec, rule, name, shards, g.tp_rank, g.dims.tp).reshape(-1)
                live[key].copy_(full[start: start + live[key].numel()].view_as(live[key]))
    model.refresh_merged()


def base_model(hf_dir: str | None) -> dict[str, Any]:
    """What a LoRA actor's adapters were trained on: model.hf_path and the size and CRC-32 of its weight files."""
    if hf_dir is None:
        return {"path": None, "files": {}}
    root = Path(hf_dir)
    return {"path": str(root.resolve()), "files": manifest.describe(root, root.glob("*.safetensors"), sync=False)}


def _check_base_model(record: Path, hf_dir: str | None) -> None:
    """The adapters resume only onto the base weights they were trained on."""
    if not record.is_file():  # a checkpoint written before the base was recorded
        return
    try:
        saved = json.loads(record.read_text())
        files = saved["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{record} is unreadable ({type(err).__name__}: {err}): the checkpoint is damaged. Resume "
                        "from another step_* directory or set checkpoint.resume to `none`.") from None
    ours = base_model(hf_dir)["files"]
    if ours != files:
        differ = sorted(n for n in set(ours) | set(files) if ours.get(n) != files.get(n))
        raise UserError(f"the LoRA adapters in {record.parent.parent} were trained on the base model at "
                        f"{saved.get('path')}, whose weight files differ from model.hf_path = {hf_dir} ({differ[:3]}: "
                        "size or CRC-32). Adapters on another base give another policy. Set model.hf_path to the "
                        "base they were trained on, or checkpoint.resume to `none`.")

