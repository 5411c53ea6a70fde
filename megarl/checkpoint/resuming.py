"""Resuming: which checkpoint (``find``: the newest that verifies), whether its bytes are sound (``verify``), and
restoring every model's state from it in any layout (``load``)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint import manifest
from megarl.checkpoint.model_files import load_model, model_states
from megarl.checkpoint.paths import COMMON, LATEST, OPTIMIZER, STEP_DIR, TRAINER, checkpoints
from megarl.errors import UserError
from megarl.models.state import Stateful


def find(resume: str, directory: str | None) -> Path | None:
    """The checkpoint to resume from, verified (collective: see ``verify``). ``auto``: the newest in
    ``directory`` that verifies; damaged ones are passed over with one line and renamed *.damaged, so that
    neither a later resume nor the rotation counts them. A named checkpoint that does not verify is an error."""
    held = sorted(checkpoints(Path(directory))) if directory is not None else []
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if held and resume != "auto" and restarts.isdigit() and int(restarts) > 0:
        # Slurm runs a requeued job with the arguments it was submitted with: a named step (or none) would start
        # every requeue there again, discarding what the job trained since
        if dist.get_rank() == 0:
            print(f"megarl: requeued by Slurm (restart {restarts}): resuming from the newest checkpoint in "
                  f"{directory}, not checkpoint.resume = {resume!r}", flush=True)
        resume = "auto"
    if resume == "none":
        if held:
            names = ", ".join(f"step_{s:06d}" for s in held[-3:])
            raise UserError(f"checkpoint.resume = 'none' starts a new run, but checkpoint.dir = {directory!r} holds "
                            f"{len(held)} checkpoint(s) of an earlier one (... {names}). The new run would mix its "
                            "checkpoints with them: its rotation would delete theirs, and one of theirs could be "
                            "kept as its best or resumed as its own. Fix: give the new run another checkpoint.dir, "
                            "set checkpoint.resume: auto to continue that run, or move those step_* directories "
                            "away.")
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
                kept = ", ".join(f"{p.name} ({why}; kept as {set_aside(p)})" for p, why in damaged)
                print(f"megarl: resuming from {path.name}, the newest checkpoint in {root} that verifies, instead "
                      f"of the damaged {kept}", flush=True)
            return path
        damaged.append((path, problem))
    if damaged:
        raise UserError(f"checkpoint.resume = 'auto' found no checkpoint in {root} that verifies: "
                        + "; ".join(f"{p.name}: {why}" for p, why in damaged)
                        + ". Nothing was loaded, deleted or renamed. Fix: restore a good copy of one of them, or set "
                        "another checkpoint.dir with checkpoint.resume: none to start fresh.")
    return None


def _candidates(root: Path) -> list[Path]:
    """Where ``auto`` looks, in order: the checkpoint ``latest`` names, then the earlier ones, newest first.
    Later ones than ``latest`` belong to a run that was resumed from an earlier checkpoint: not this one's."""
    found = checkpoints(root)
    newest_first = [found[s] for s in sorted(found, reverse=True)]
    if not (root / LATEST).is_file():
        return newest_first
    text = (root / LATEST).read_text().strip()
    match = STEP_DIR.fullmatch(text)
    if match is None:  # a damaged pointer ("", ".", a path): every checkpoint is a candidate, and only they
        if dist.get_rank() == 0:
            print(f"megarl: {root / LATEST} reads {text[:80]!r}, not a checkpoint's name: resuming from the newest "
                  "checkpoint that verifies", flush=True)
        return newest_first
    named, below = root / text, int(match.group(1))
    later = [found[s].name for s in sorted(found, reverse=True) if s > below]
    if later and dist.get_rank() == 0:
        print(f"megarl: {root} holds {', '.join(later)}, later than `latest` ({text}): left alone (a run resumed from "
              "an earlier checkpoint wrote them, or a save stopped before it moved `latest`). To resume from one, "
              f"set checkpoint.resume to its path ({root / later[0]}).", flush=True)
    return [named] + [found[s] for s in sorted(found, reverse=True) if s < below]


def set_aside(path: Path) -> str:
    """Rename a damaged checkpoint *.damaged (out of every later resume's and rotation's sight); its new name."""
    if not path.exists():
        return "nothing: it is missing"
    if not STEP_DIR.fullmatch(path.name):  # never checkpoint.dir itself, or anything but a checkpoint in it
        return "nothing: not a checkpoint's directory"
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


def load(path: Path, models: Mapping[str, Stateful], prepare: Callable[[str], None] | None = None
         ) -> dict[str, Any]:
    """Restore weights, optimizer state and LR schedule in any layout, and the RNG states in the same one.
    ``prepare(role)`` runs before each model is written, as in ``save``. A model the checkpoint does not hold (another
    architecture or role) is refused before anything of it is written."""
    saved = json.loads((path / TRAINER).read_text())
    layout = None
    for role, state in model_states(models, prepare):
        layout = layout or dataclasses.asdict(state.groups.dims)
        load_model(state, path / role)
    if saved.get("layout") == layout:
        _set_rng_state(torch.load(path / f"rank{dist.get_rank()}.pt", weights_only=False)["rng"])
    elif dist.get_rank() == 0:
        print(f"megarl: {path} was saved in layout {saved.get('layout')}; weights and optimizer state were "
              "resharded", flush=True)
    return saved


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
