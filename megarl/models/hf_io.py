"""Read and write HuggingFace safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.errors import UserError
from megarl.models.spec import ModelSpec
from megarl.platform.files import fsync_file

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "generation_config.json", "vocab.json", "merges.txt", "chat_template.jinja")


class HFReader:
    """Lazy access to the tensors of a HF checkpoint; each read opens only the slice it needs."""

    def __init__(self, hf_dir: str | Path, spec: ModelSpec, expected: dict[str, tuple[int, ...]]) -> None:
        self.dir = Path(hf_dir)
        self.spec = spec
        self._handles: dict[Path, Any] = {}
        self.files = self._locate(expected)
        self._check_shapes(expected)

    def _locate(self, expected: dict[str, tuple[int, ...]]) -> dict[str, Path]:
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(f"{index} is corrupt ({err!r}). Re-download the model.") from None
            files = {name: self.dir / f for name, f in weight_map.items()}
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise UserError(f"`{self.dir}` holds no *.safetensors weights. Convert the model to safetensors "
                                "(transformers: save_pretrained(..., safe_serialization=True)).")
            files = {}
            for shard in shards:
                for name in self._open(shard).keys():
                    files[name] = shard
        missing = sorted(set(expected) - set(files))
        if missing:
            raise UserError(f"`{self.dir}` lacks {len(missing)} tensor(s) its config.json implies, e.g. "
                            f"{missing[:3]}. The weights do not match the config; re-download the model.")
        return files

    def _open(self, path: Path) -> Any:
        if path not in self._handles:
            if not path.is_file():
                raise UserError(f"weight file `{path}` named by the index does not exist. Re-download the model.")
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise UserError(f"`{path}` is not a readable safetensors file ({err}). Re-download it.") from None
            self._handles[path] = handle
        return self._handles[path]

    def _check_shapes(self, expected: dict[str, tuple[int, ...]]) -> None:
        for name, shape in expected.items():
            got = tuple(self._open(self.files[name]).get_slice(name).get_shape())
            if got != shape:
                raise UserError(f"tensor `{name}` in `{self.files[name]}` has shape {list(got)} but config.json "
                                f"implies {list(shape)}. The weights and config.json disagree.")

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        view = self._open(self.files[name]).get_slice(name)
        if dim is None:
            return view[:]
        index = (slice(None),) * dim + (slice(start, stop),)
        return view[index]


def copy_model_files(src: Path, dst: Path) -> None:
    """Copy config.json and the tokenizer files that exist in ``src`` (byte for byte) into ``dst``."""
    for fname in ("config.json", *TOKENIZER_FILES):
        if (src / fname).is_file():
            shutil.copy2(src / fname, dst / fname)


def apply_umask(root: Path) -> None:
    """Give ``root`` and everything below it the permissions the user's umask asks for (temporary files and
    directories are created private, 0600/0700, whatever the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _sync(*groups: Iterable[Path] | Path) -> None:
    """fsync these files and directories: a rename publishes only what is on disk (after a power loss, an export
    renamed into place could otherwise hold empty files)."""
    for path in (p for g in groups for p in ([g] if isinstance(g, Path) else g)):
        fsync_file(path)


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """A temporary directory beside ``out``, renamed to ``out`` when the block succeeds and removed
    when it fails, so a crash never leaves a half-written ``out``. ``out`` must not hold files."""
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output directory `{out}` exists and is not empty. Choose a new --out path.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        apply_umask(tmp)
        _sync(tmp.rglob("*"), tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with contextlib.suppress(OSError):  # the export is in place: a file system that cannot sync a directory
        _sync(out.parent)  # (EINVAL) must not make it look failed


def write_hf(out_dir: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec,
             source_dir: str | Path | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write a HF checkpoint atomically: a temporary directory renamed to ``out_dir`` at the end."""
    with atomic_dir(Path(out_dir)) as tmp:
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, shards = 0, []
        floats: set[torch.dtype] = set()
        for name, tensor in tensors:
            if tensor.is_floating_point():
                floats.add(tensor.dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + nbytes > max_shard_bytes:
                shards.append(shard)
                shard, shard_bytes = {}, 0
            shard[name] = tensor.contiguous()
            shard_bytes += nbytes
        shards.append(shard)
        weight_map: dict[str, str] = {}
        for i, part in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(part, str(tmp / fname), metadata={"format": "pt"})
            weight_map |= {name: fname for name in part}
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for part in shards for t in part.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
        if source_dir is not None:  # its tokenizer and generation config; config.json is the spec's (a critic's
            copy_model_files(Path(source_dir), tmp)  # checkpoint exports as a reward model)
        (tmp / "config.json").write_text(json.dumps(stated_dtype(spec.hf_config, floats), indent=2) + "\n")


def stated_dtype(config: dict[str, Any], dtypes: set[torch.dtype]) -> dict[str, Any]:
    """``config`` stating the dtype of the weights written beside it, ``dtypes`` (transformers' dtype="auto", SGLang
    and vLLM load in it): an fp32 base trained in bf16 exports bf16 weights. Weights of mixed dtypes are the
    source's own, kept by a bit-exact round trip, so its config already says what it meant by them."""
    if len(dtypes) != 1:
        return config
    name = str(next(iter(dtypes))).removeprefix("torch.")
    # transformers 5 writes `dtype`, older files `torch_dtype`: set whichever the config has
    return config | {key: name for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]}
