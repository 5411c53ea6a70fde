"""A part of a training checkpoint read outside training (`evaluate --model`, `convert mcore-to-hf`): its files are
checked against the checkpoint's manifest first, as a resume checks them, so that damaged weights are refused
rather than evaluated or exported (zeroed weights used to give an all-zero model, exit 0)."""

from __future__ import annotations

from pathlib import Path

from megarl.checkpoint import manifest
from megarl.checkpoint.paths import TRAINER
from megarl.errors import UserError


def checkpoint_of(model_dir: Path) -> Path | None:
    """The training checkpoint (step_N) that ``model_dir`` is a part of (step_N/actor), if it is one."""
    step_dir = model_dir.resolve().parent
    return step_dir if (step_dir / TRAINER).is_file() or (step_dir / manifest.MANIFEST).is_file() else None


def check_part(model_dir: Path, flag: str) -> None:
    """Refuse ``model_dir`` (given as ``flag``) when it is part of a training checkpoint and its files do not
    match that checkpoint's manifest; a checkpoint of a megarl before manifests passes with a line."""
    fix = "Fix: use another checkpoint of the run (its step_N/actor)."
    parent = model_dir.resolve().parent.name
    if parent.startswith(".step_") and parent.endswith(".tmp"):  # never published
        raise UserError(f"{flag} {model_dir} is part of {parent}, a checkpoint that a save was still writing when it "
                        f"stopped: it was never verified. {fix}")
    step_dir = checkpoint_of(model_dir)
    if step_dir is None:
        return
    try:
        files = manifest.read(step_dir)
    except manifest.ManifestError as err:
        raise UserError(f"{flag} {model_dir}: {err}. {fix}") from None
    if files is None:
        print(f"megarl: {step_dir} has no {manifest.MANIFEST} (saved by a megarl before checksums): {model_dir} is "
              "not verified", flush=True)
        return
    prefix = model_dir.resolve().relative_to(step_dir).as_posix() + "/"
    bad = manifest.problems(step_dir, files, [n for n in files if n.startswith(prefix)])
    if bad:
        raise UserError(f"{flag} {model_dir} is damaged: {bad[0]}. {fix}")
