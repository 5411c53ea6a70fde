"""The rollout engine protocol shared by the SGLang and vLLM adapters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from megarl.errors import UserError


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = off."""
    max_new_tokens: int = 256
    """Most tokens generated per sample."""
    stop_token_ids: Sequence[int] = ()
    """Generation stops after any of these tokens."""
    seed: int | None = None
    """Base sampling seed (request i uses seed + i); None = engine's own randomness."""

    def __post_init__(self) -> None:
        checks = [("n", self.n >= 1, ">= 1"), ("temperature", self.temperature >= 0, ">= 0"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"), ("top_k", self.top_k == -1 or self.top_k >= 1,
                                                                 "-1 or >= 1"),
                  ("max_new_tokens", self.max_new_tokens >= 1, ">= 1")]
        for name, ok, must in checks:
            if not ok:
                raise UserError(f"sampling `{name}` = {getattr(self, name)!r} must be {must}.")


@dataclass(slots=True)
class Completion:
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    """The engine's log-probability of each generated token."""
    finish_reason: Literal["stop", "length"]


class RolloutEngine(Protocol):
    max_model_len: int

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]: ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def shutdown(self) -> None: ...
