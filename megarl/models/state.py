"""What a model hands a checkpoint (megarl.checkpoint): the checkpoint knows files, manifests and layouts; the
model knows its weights, its optimizer's state and whatever it keeps beside them (LoRA adapters). A model gives
its state through ``ModelState`` alone, as torchtitan's checkpoint manager asks its parts for their state dicts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from megarl.distributed.parallel import ParallelGroups
from megarl.models.spec import ModelSpec

if TYPE_CHECKING:
    from megarl.models.optimizer_state import OptimizerState


class StatePart(Protocol):
    """State a model keeps beside its weights and optimizer (a LoRA actor's adapters). It writes and reads its own
    files inside the model's checkpoint directory; the checkpoint checksums and publishes them with the rest."""

    def save(self, out: Path, model: ModelState) -> list[Path]:
        """Write this rank's files under ``out`` (the model's directory; every rank calls it); the files written."""
        ...

    def load(self, ckpt: Path, model: ModelState) -> None:
        """Restore from the model's directory ``ckpt``, in any layout (after the optimizer state exists)."""
        ...


@dataclass(frozen=True)
class ModelState:
    """One model's state as this rank holds it."""

    spec: ModelSpec
    groups: ParallelGroups
    hf_dir: str | None
    """model.hf_path: its tokenizer and generation config go beside the weights (None: random weights)."""
    critic: bool
    vocab_pad_multiple: int
    weights: dict[str, torch.Tensor]
    """This rank's weights by canonical Megatron name, current (a LoRA actor's adapted ones merged, W + s B A)."""
    optimizer: OptimizerState | None
    """None for a model that does not train."""
    parts: tuple[StatePart, ...] = ()

    @property
    def padded_vocab_size(self) -> int:
        return self.spec.padded_vocab_size(self.groups.dims.tp, self.vocab_pad_multiple)


class Stateful(Protocol):
    """A model as a checkpoint sees it (megarl.models.trainable.MegatronModel)."""

    def state(self) -> ModelState:
        """This rank's state, its tensors live: a load writes into them."""
        ...
