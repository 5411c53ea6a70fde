"""actor.lora.handover: adapter. The engine keeps the base weights it loaded from model.hf_path, which are the
actor's frozen ones, and serves the adapters through its own LoRA support: after every update the engine's driver
writes the actor's adapters as a PEFT adapter directory (megarl.lora.export.write_peft) and the engine loads it in
place of the last. Nothing else moves: the adapters are a few MB where the merged weights are the whole model.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from megarl.config.lora import LoraConfig
from megarl.lora.export import write_peft


class AdapterHandover:
    """Hands a LoRA actor (TP1, PP1: every rank holds its adapters whole) to its group's engine."""

    def __init__(self, actor: Any, cfg: LoraConfig, engine: Any, run_dir: Path) -> None:
        """The adapters go to ``run_dir``/adapters/engine_<the group's index>: one directory per engine, as every
        group's driver writes its own, numbered from 0 in each process. Whatever an earlier process of the run left
        there (a resume in the same checkpoint.dir) is removed first, not taken for this run's."""
        self.actor, self.cfg, self.engine = actor, cfg, engine
        self.directory = run_dir / "adapters" / f"engine_{engine.group.index}"
        if engine.engine is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory.mkdir(parents=True)
        self._written: list[Path] = []
        self._count = 0

    def __call__(self) -> None:
        path = None
        if self.engine.engine is not None:  # the group's driver writes, its engine reads
            path = self.directory / f"adapter_{self._count:06d}"
            partial = path.with_name(path.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            params = self.actor.adapter_params()
            write_peft(partial, self.actor.spec, dataclasses.asdict(self.cfg),
                       lambda name: [params[name].detach().cpu()])
            partial.rename(path)
            self._written.append(path)
            while len(self._written) > 2:  # the engine reads the last one at its next generate
                shutil.rmtree(self._written.pop(0), ignore_errors=True)
        self.engine.load_adapter(path)
        self._count += 1
