"""Saving: atomic (a temporary directory renamed into place once every rank's files are durable and checksummed),
with a clear error when the disk is full, then ``latest`` and the rotation."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint import manifest
from megarl.checkpoint.model_files import model_states, save_model
from megarl.checkpoint.paths import LATEST, OPTIMIZER, TRAINER, checkpoints, rotate
from megarl.errors import UserError
from megarl.models.hf_io import apply_umask
from megarl.models.state import Stateful

FULL_BELOW = 64 * 2**20
"""A save that fails with less free space than this in checkpoint.dir failed for the lack of it."""


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(directory: str, step: int, models: Mapping[str, Stateful], trainer_state: dict[str, Any],
         keep_last: int, prepare: Callable[[str], None] | None = None) -> Path:
    """Save after ``step`` (collective: every rank calls it). ``prepare(role)`` runs before each model is
    read: it brings the model's offloaded state back to the device (megarl.memory.offload). Every rank fsyncs and
    checksums the files it wrote; rank 0 writes the manifest, fsyncs the directories, renames the checkpoint
    into place, points ``latest`` at it and rotates."""
    started = time.perf_counter()
    root = Path(directory)
    name = f"step_{step:06d}"
    tmp = root / f".{name}.tmp"
    rank = dist.get_rank()
    try:
        _write_and_publish(root, name, tmp, step, models, trainer_state, keep_last, prepare)
    except BaseException as err:
        # An interrupt anywhere in the save (the barrier and the gathers included) abandons the checkpoint: nothing
        # half-written stays. An error has removed it already, or leaves it for the report that names it.
        if rank == 0 and not isinstance(err, Exception):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        final = root / name
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        print(f"megarl: saved {final} ({size / 2**20:.1f} MiB in {time.perf_counter() - started:.1f} s)", flush=True)
    return root / name


def _write_and_publish(root: Path, name: str, tmp: Path, step: int, models: Mapping[str, Stateful],
                       trainer_state: dict[str, Any], keep_last: int, prepare: Callable[[str], None] | None) -> None:
    """``save``'s work: every rank writes its files into ``tmp``, every rank learns of any rank's failure, and rank 0
    publishes ``tmp`` as ``root / name``."""
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for role in models:
            (tmp / role / OPTIMIZER).mkdir(parents=True)
    dist.barrier()
    error: BaseException | None = None
    files: dict[str, dict[str, Any]] = {}
    try:
        written = [tmp / f"rank{rank}.pt"]
        layout = None
        for role, state in model_states(models, prepare):
            layout = layout or dataclasses.asdict(state.groups.dims)
            written += save_model(state, tmp / role)
        torch.save({"rng": _rng_state()}, written[0])
        if rank == 0:
            (tmp / TRAINER).write_text(json.dumps(trainer_state | {"step": step, "layout": layout,
                                                                    "manifest": manifest.VERSION}))
        files = manifest.describe(tmp, [p for p in written if p.exists()])
    except Exception as err:  # noqa: BLE001 (every rank learns of it below, so that none waits for the others)
        error = err
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (_describe_error(error, root), files))
    failed = [(r, e) for r, (e, _) in enumerate(reports) if e is not None]
    published: list[Any] = [None]  # rank 0's failure to publish, if any
    if rank == 0:
        if not failed:
            try:
                _publish(root, tmp, name, {k: v for _, f in reports for k, v in f.items()}, keep_last)
            except _Published as err:
                published[0] = str(err)
            except Exception as err:  # noqa: BLE001
                error, published[0] = err, _describe_error(err, root)
        if failed or published[0] is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.broadcast_object_list(published, src=0)
    if isinstance(published[0], str):
        raise UserError(published[0]) from None
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
        shutil.rmtree(old, ignore_errors=True)  # the new one is in place: a leftover .old is never read
    else:
        os.replace(tmp, final)
    try:
        manifest.fsync_dir(root)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(name)
        manifest.fsync_file(pointer)
        os.replace(pointer, root / LATEST)
        manifest.fsync_dir(root)
    except Exception as err:  # noqa: BLE001 - named, with what is where now
        raise _Published(_published_message(root, name, "pointing `latest` at it", err)) from err
    try:
        rotate(root, keep_last, final)
    except Exception as err:  # noqa: BLE001
        raise _Published(_published_message(root, name, f"removing checkpoints older than the last {keep_last}",
                                             err)) from err


class _Published(Exception):
    """A failure after the checkpoint was renamed into place: it is complete, so the message says what is where."""


def _published_message(root: Path, name: str, what: str, err: Exception) -> str:
    full, detail = _describe_error(err, root) or (False, repr(err))
    try:
        latest = (root / LATEST).read_text().strip() or "nothing"
    except OSError:
        latest = "nothing"
    where = "`latest` names it" if latest == name else \
        f"`latest` still names {latest}, which checkpoint.resume: auto would resume from"
    fix = f"free space in {root}, then " if full else ""
    resume = "checkpoint.resume: auto" if latest == name else f"checkpoint.resume: {root / name}"
    return (f"checkpoint.dir = {str(root)!r}: {name} is saved and verifies, but {what} failed ({detail}); {where}. "
            f"Nothing was deleted. Fix: {fix}resume with {resume}.")
