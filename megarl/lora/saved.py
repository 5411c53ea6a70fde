"""A LoRA actor's adapters as a checkpoint holds them: ``actor/lora/rank{r}.safetensors``, one per rank (that rank's
factor shards by canonical name, and its range of their optimizer state as ``name/key``), and ``base_model.json``.
Read by the resume (megarl.checkpoint) and the PEFT export (megarl.lora.export).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megarl.errors import UserError

LORA_DIR = "lora"
"""In an actor's checkpoint directory: the adapters and their optimizer state, one file per rank."""
BASE_MODEL = "base_model.json"
"""In LORA_DIR: the base model's path and the size and CRC-32 of its weight files, checked on resume."""


def adapter_files(ckpt: Path) -> list[Path]:
    """The rank files of the actor checkpoint ``ckpt`` (none: it was not saved with actor.lora)."""
    return sorted((ckpt / LORA_DIR).glob("rank*.safetensors"))


class SavedAdapters:
    """The factor shards in a checkpoint's rank files, by canonical name and saved TP rank, and the LoraConfig
    (``lora``, its fields) and TP size they were saved with."""

    def __init__(self, files: list[Path]) -> None:
        self.params: dict[str, dict[int, Any]] = defaultdict(dict)
        self.tp, self.lora = 1, {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
                meta = handle.metadata()
                tp_rank = int(meta["tp_rank"])
                self.tp, self.lora = int(meta["tp"]), json.loads(meta["lora"])
            except (SafetensorError, OSError, KeyError, ValueError) as err:
                raise UserError(f"LoRA adapters `{path}` are unreadable ({err}). The checkpoint is damaged; resume "
                                "from another step_* directory or start anew in another checkpoint.dir.") from None
            for name in handle.keys():
                if "/" not in name:  # a factor; its optimizer state is name/key
                    self.params[name][tp_rank] = handle
        self.directory = files[0].parent

    def factor(self, name: str) -> list[torch.Tensor]:
        """``name``'s shards, by saved TP rank."""
        held = self.params.get(name, {})
        if sorted(held) != list(range(self.tp)):
            raise UserError(f"{self.directory} lacks TP shards {sorted(set(range(self.tp)) - set(held))} of the "
                            f"adapter {name} (of {self.tp}): the checkpoint is damaged or incomplete. Resume from "
                            "another step_* directory or start anew in another checkpoint.dir.")
        return [held[t].get_tensor(name) for t in range(self.tp)]
