"""Trainable adapters over a model's frozen weights, as MegatronModel sees them. The model knows this interface,
not how adapters are made: megarl.lora.training.LoraAdapters is the one kind, handed to MegatronModel by whoever
builds the actor."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from megarl.models.state import StatePart


class Adapters(Protocol):
    def install(self, chunks: Sequence[torch.nn.Module], layer_offsets: Sequence[int]) -> None:
        """Put the adapters on ``chunks`` (unwrapped, weights loaded, before DDP) and freeze the base weights;
        chunk ``vp``'s first layer is global layer ``layer_offsets[vp]``."""
        ...

    def params(self) -> dict[str, torch.nn.Parameter]:
        """This rank's adapter parameters by canonical name (global layer numbers)."""
        ...

    def merged(self, canonical: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        """``canonical`` (the base parameters by name) as tensors, each adapted weight replaced by its merged
        form: what the resharder reads and a checkpoint writes."""
        ...

    def refresh_merged(self) -> None:
        """Write the current merged weights into the tensors ``merged`` returns (before a hand-over or a save)."""
        ...

    def disabled(self) -> AbstractContextManager[None]:
        """Inside the block the model is its base: the adapters are off."""
        ...

    def dropout(self) -> AbstractContextManager[None]:
        """Inside the block the adapters' dropout is on: an update's forward and backward."""
        ...

    def state_part(self) -> StatePart:
        """The adapters and their optimizer state as a checkpoint saves and restores them."""
        ...
