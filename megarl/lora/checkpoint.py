"""A LoRA actor's adapters in a checkpoint (its StatePart, megarl.models.state): every rank writes its adapters
(this rank's shards, by canonical name) and their optimizer state (its own range of them with the distributed
optimizer) to lora/rank{r}.safetensors, and rank 0 the base model's identity to lora/base_model.json. The model's
weights written beside them are the merged W + s B A (an export of the adapted model); its base weights come from
model.hf_path again on resume, which must be the base the adapters were trained on."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.checkpoint import manifest
from megarl.config.lora import LoraConfig
from megarl.distributed.rank0 import from_rank0
from megarl.errors import UserError
from megarl.lora import shards as lora_shards
from megarl.lora.saved import BASE_MODEL, LORA_DIR, SavedAdapters, adapter_files
from megarl.models.mapping import param_rules
from megarl.models.mcore_ckpt import FORMAT
from megarl.models.optimizer_state import STATE_KEYS, flat_state, saved_state
from megarl.models.state import ModelState


class AdapterState:
    """``params()``: the adapters by canonical name; ``refresh``: rewrites the merged weights after a load."""

    def __init__(self, cfg: LoraConfig, params: Callable[[], dict[str, torch.nn.Parameter]],
                 refresh: Callable[[], None]) -> None:
        self.cfg, self.params, self.refresh = cfg, params, refresh
        self._base: dict[str, Any] | None = None
        """base_model's record, read at the first save (a 70B base is 140 GB to checksum: once a run)."""

    def save(self, out: Path, model: ModelState) -> list[Path]:
        assert model.optimizer is not None
        g, params = model.groups, self.params()
        tensors = {name: p.detach().cpu().contiguous() for name, p in params.items()}
        # As the optimizer's own state: each DP rank its range with the distributed optimizer, else DP rank 0 all.
        mine = model.optimizer.distributed or g.dp_rank == 0
        state, offsets = flat_state(model.optimizer.slots(params) if mine else {},
                                    {n: p.shape for n, p in params.items()}, clone=True)
        (out / LORA_DIR).mkdir(exist_ok=True)
        path = out / LORA_DIR / f"rank{dist.get_rank():04d}.safetensors"
        written = [path]
        if dist.get_rank() == 0:
            written.append(out / LORA_DIR / BASE_MODEL)
            if self._base is None:
                self._base = base_model(model.hf_dir)
            written[-1].write_text(json.dumps(self._base, indent=1) + "\n")
        save_file(tensors | state, str(path), metadata={
            "format": FORMAT, "offsets": json.dumps(offsets), "tp_rank": str(g.tp_rank), "tp": str(g.dims.tp),
            "dp_rank": str(g.dp_rank), "lora": json.dumps(dataclasses.asdict(self.cfg))})
        return written

    @torch.no_grad()
    def load(self, ckpt: Path, model: ModelState) -> None:
        """In any layout: each factor's TP shards (its state's joined from the DP ranges that held them) are joined
        and split again as its base weight's are (megarl.lora.shards), a pure copy in the layout they were saved
        in."""
        assert model.optimizer is not None
        files = adapter_files(ckpt)
        if not files:
            raise UserError(f"{ckpt} holds no LoRA adapters ({LORA_DIR}/ is missing): it was saved without "
                            "actor.lora. Resume it without actor.lora, or start anew in another checkpoint.dir.")
        check_base_model(ckpt / LORA_DIR / BASE_MODEL, model.hf_dir, dist.get_rank())
        saved = SavedAdapters(files)
        theirs = {k: saved.lora.get(k) for k in ("rank", "target_modules")}
        ours = {"rank": self.cfg.rank, "target_modules": list(self.cfg.target_modules)}
        if theirs != ours:
            raise UserError(f"{ckpt} holds adapters of actor.lora {theirs}, this actor has {ours}. Resume with the "
                            "checkpoint's actor.lora, or start anew in another checkpoint.dir.")
        g, spec = model.groups, model.spec
        rules = {r.mcore: r for r in param_rules(spec, include_output=False)}
        params = self.params()
        slots = model.optimizer.slots(params)
        state = saved_state(ckpt / LORA_DIR, "rank*.safetensors")
        for name, p in params.items():
            rule = rules[lora_shards.base_weight(name)]
            p.copy_(lora_shards.reshard_factor(spec, rule, name, saved.factor(name), g.tp_rank, g.dims.tp))
            if name in slots:
                start, live = slots[name]
                for key in STATE_KEYS:
                    shards = [state(key)(t, name) for t in range(saved.tp)]
                    full = lora_shards.reshard_factor(spec, rule, name, shards, g.tp_rank, g.dims.tp).reshape(-1)
                    live[key].copy_(full[start: start + live[key].numel()].view_as(live[key]))
        self.refresh()


def base_model(hf_dir: str | None) -> dict[str, Any]:
    """What a LoRA actor's adapters were trained on: model.hf_path and the size and CRC-32 of its weight files."""
    return {"path": None, "files": {}} if hf_dir is None else manifest.weight_files(hf_dir)


def check_base_model(record: Path, hf_dir: str | None, rank: int = 0) -> None:
    """The adapters resume only onto the base weights they were trained on: rank 0 checksums the base's files and
    every rank refuses alike (a 70B base is 140 GB to read: once, not once per rank); every rank calls it."""
    if not record.is_file():  # a checkpoint written before the base was recorded
        return
    try:
        saved = json.loads(record.read_text())
        files = saved["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{record} is unreadable ({type(err).__name__}: {err}): the checkpoint is damaged. Resume "
                        "from another step_* directory or start anew in another checkpoint.dir.") from None
    differ = from_rank0(lambda: manifest.files_differ(files, hf_dir), rank) if hf_dir is not None else sorted(files)
    if differ:
        raise UserError(f"the LoRA adapters in {record.parent.parent} were trained on the base model at "
                        f"{saved.get('path')}, whose weight files differ from model.hf_path = {hf_dir} ({differ[:3]}: "
                        "size or CRC-32). Adapters on another base give another policy. Set model.hf_path to the "
                        "base they were trained on, or start a new run in another checkpoint.dir.")
