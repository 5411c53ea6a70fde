"""A checkpoint's manifest: the size and CRC-32 of every file in it, recorded at save and checked before a resume.

CRC-32 (zlib) because it is the fastest checksum in the standard library (7.1 GB/s on one core of the 2-core CI
machine, against 2.1 GB/s for sha256 and 1.4 GB/s for blake2b: `python benchmarks/checkpoint_hash_rate.py`) and
damage here is accidental (zeroed or truncated bytes, a bad disk), not adversarial; zlib.crc32 releases the GIL,
so one rank's files are checksummed on several threads. The checksums are computed by reading each file back
from the file system after its fsync, so they describe what a resume will read.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megarl.checkpoint.paths import TRAINER
from megarl.platform.files import fsync_file

MANIFEST = "manifest.json"
VERSION = 1
"""The manifest format; trainer.json records it too, so that a checkpoint saved with a manifest that has lost it
reads as damaged, not as one of a megarl before manifests."""
CHUNK = 16 * 2**20
THREADS = 4


class ManifestError(Exception):
    """The manifest itself cannot be read (truncated, not JSON, not a manifest)."""


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (created and renamed files) durable: a file's fsync does not cover them."""
    fsync_file(path)


def crc32(path: Path) -> str:
    value, buffer = 0, bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            value = zlib.crc32(view[:n], value)
    return f"{value:08x}"


def describe(root: Path, paths: Iterable[Path], sync: bool = True) -> dict[str, dict[str, Any]]:
    """{path relative to ``root``: {"bytes", "crc32"}} of each file, each fsynced first (``sync``)."""
    def entry(path: Path) -> tuple[str, dict[str, Any]]:
        if sync:
            fsync_file(path)
        return path.relative_to(root).as_posix(), {"bytes": path.stat().st_size, "crc32": crc32(path)}

    with ThreadPoolExecutor(THREADS) as pool:
        return dict(pool.map(entry, sorted(paths)))


def weight_files(hf_dir: str) -> dict[str, Any]:
    """What an HF model directory's weights are: its resolved path and the size and CRC-32 of each safetensors file
    (what LoRA adapters were trained on, which teacher a distillation run learned from)."""
    root = Path(hf_dir)
    return {"path": str(root.resolve()), "files": describe(root, root.glob("*.safetensors"), sync=False)}


def files_differ(files: dict[str, Any], hf_dir: str) -> list[str]:
    """The safetensors files of ``hf_dir`` whose size or CRC-32 differ from ``files`` (a weight_files record),
    or that only one side has, sorted."""
    ours = weight_files(hf_dir)["files"]
    return sorted(n for n in set(ours) | set(files) if ours.get(n) != files.get(n))


def write(root: Path, files: dict[str, dict[str, Any]]) -> None:
    """Write ``root``/manifest.json (inside a checkpoint's temporary directory: its rename publishes it)."""
    path = root / MANIFEST
    path.write_text(json.dumps({"format": "megarl-manifest", "version": VERSION, "files": dict(sorted(files.items()))},
                                 indent=1) + "\n")
    fsync_file(path)


def read(root: Path) -> dict[str, dict[str, Any]] | None:
    """The files the manifest lists; None if there is none and trainer.json says none was written (a checkpoint of
    a megarl before manifests). A manifest trainer.json says was written but is not there is a ManifestError."""
    path = root / MANIFEST
    if not path.exists():
        try:
            recorded = json.loads((root / TRAINER).read_text()).get("manifest")
        except (OSError, ValueError, AttributeError):
            recorded = None  # an unreadable trainer.json is reported as such where it is read
        if recorded is not None:
            raise ManifestError(f"{path} is missing, though trainer.json says the checkpoint was saved with one "
                                f"(version {recorded}): the checkpoint is damaged, its files cannot be verified")
        return None
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if data.get("format") != "megarl-manifest" or not all(
                isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("crc32"), str)
                for e in files.values()):
            raise ValueError("not a megarl manifest")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ManifestError(f"{path} is unreadable ({type(err).__name__}: {err})") from None
    return dict(files)


def share(files: dict[str, dict[str, Any]], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` checks: the largest first, each to the rank with the fewest bytes
    so far, so that every rank reads about the same amount."""
    loads = [0] * world
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        owner = loads.index(min(loads))
        loads[owner] += files[name]["bytes"]
        if owner == rank:
            mine.append(name)
    return mine


def problems(root: Path, files: dict[str, dict[str, Any]], names: Iterable[str]) -> list[str]:
    """What is wrong with each of ``names`` (missing, another size, another checksum); empty if they verify."""
    def check(name: str) -> str | None:
        path, want = root / name, files[name]
        try:
            size = path.stat().st_size
            if size != want["bytes"]:
                return f"{path} has {size} bytes, the manifest says {want['bytes']}"
            got = crc32(path)
        except OSError as err:
            return f"{path} is missing or unreadable ({err.strerror or err})"
        if got != want["crc32"]:
            return f"{path} has CRC-32 {got}, the manifest says {want['crc32']} (its contents changed)"
        return None

    with ThreadPoolExecutor(THREADS) as pool:
        return [p for p in pool.map(check, list(names)) if p is not None]
