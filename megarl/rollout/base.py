"""The rollout engine protocol shared by the SGLang and vLLM adapters."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
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
    """Base sampling seed (request i's j-th sample uses seed + i * n + j); None = engine's own randomness."""
    seeds: Sequence[int] | None = None
    """One seed per prompt, in place of seed + i * n (its j-th sample uses it + j): a sample keeps its seed
    whatever call, and whichever engine, it is in."""
    budgets: Sequence[int] | None = None
    """One max_new_tokens per prompt, in place of max_new_tokens: partial rollouts resume each sample with the
    tokens it has left."""

    def __post_init__(self) -> None:
        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def number(value: object) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN

        checks = [("n", integer(self.n) and self.n >= 1, "an integer >= 1"),
                  ("temperature", number(self.temperature) and self.temperature >= 0, "a number >= 0"),
                  ("top_p", number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
                  ("top_k", integer(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "-1 or an integer >= 1"),
                  ("max_new_tokens", integer(self.max_new_tokens) and self.max_new_tokens >= 1, "an integer >= 1"),
                  ("stop_token_ids", isinstance(self.stop_token_ids, Sequence)
                   and not isinstance(self.stop_token_ids, str | bytes)
                   and all(integer(t) and t >= 0 for t in self.stop_token_ids), "a list of token ids >= 0"),
                  ("seed", self.seed is None or integer(self.seed), "an integer or null"),
                  ("seeds", self.seeds is None or all(integer(x) for x in self.seeds), "null, or integers"),
                  ("budgets", self.budgets is None or all(integer(x) and x >= 1 for x in self.budgets),
                   "null, or integers >= 1")]
        for name, ok, must in checks:
            if not ok:
                raise UserError(f"sampling `{name}` = {getattr(self, name)!r} must be {must}.")


@dataclass(slots=True)
class Completion:
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    """The engine's log-probability of each generated token."""
    finish_reason: Literal["stop", "length", "abort"]
    """abort: ``generate_until`` stopped the sample before either; it holds the tokens it had (Aborting)."""
    routed_experts: np.ndarray | None = None
    """MoE engines started with ``return_routed_experts``: [len(prompt) + len(token_ids) - 1, num_layers, k],
    the experts every layer routed each token it ran to (the last sampled token never runs)."""
    policy_mask: list[int] | None = None
    """Multi-turn rollouts (megarl.rollout.agent): 1 at the policy's tokens, 0 at tool tokens; None = all policy."""
    stats: dict[str, float] | None = None
    """Multi-turn rollouts: the sample's turns, tool calls and the like (megarl.rollout.agent.STATS)."""


def request_seed(params: SamplingParams, i: int) -> int | None:
    """The seed of request i, whose j-th sample draws at it + j: ``seeds[i]``, or seed + i * n."""
    if params.seeds is not None:
        return params.seeds[i]
    return None if params.seed is None else params.seed + i * params.n


def request_budget(params: SamplingParams, i: int) -> int:
    """Most new tokens of request i: ``budgets[i]``, or max_new_tokens."""
    return params.max_new_tokens if params.budgets is None else params.budgets[i]


def check_prompts(prompts: Sequence[Sequence[int]], params: SamplingParams, max_model_len: int,
                  vocab_size: int | None = None) -> None:
    """Reject, never truncate: an empty prompt, a token id outside the vocabulary, or a prompt that leaves
    no room for ``max_new_tokens`` within the engine's ``max_model_len``."""
    if params.seeds is not None and len(params.seeds) != len(prompts):
        raise ValueError(f"{len(params.seeds)} sampling seeds for {len(prompts)} prompts")
    if params.budgets is not None and len(params.budgets) != len(prompts):
        raise ValueError(f"{len(params.budgets)} token budgets for {len(prompts)} prompts")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise UserError(f"prompt {i} is empty; every prompt needs at least one token.")
        if vocab_size is not None and not 0 <= min(prompt) <= max(prompt) < vocab_size:
            raise UserError(f"prompt {i} holds token ids outside [0, {vocab_size}) (min {min(prompt)}, max "
                            f"{max(prompt)}); it was tokenized for another model.")
        if len(prompt) + request_budget(params, i) > max_model_len:
            raise UserError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                            f"{request_budget(params, i)} it exceeds the engine's limit of {max_model_len} "
                            "tokens. Raise the limit or shorten the prompts (rollout.max_prompt_tokens, "
                            "data.drop_long_prompts).")


@contextmanager
def engine_process_env(**env: str) -> Iterator[None]:
    """The environment an engine starts its processes in; ``env`` adds variables (such as the group's
    CUDA_VISIBLE_DEVICES). Everything is restored afterwards.

    - megarl's root goes on PYTHONPATH: engines import megarl's loader by name in processes they may
      start with ``spawn``, and megarl may be importable here only through this process's sys.path.
    - torchrun's TORCHELASTIC_USE_AGENT_STORE is hidden: inherited by the engine's processes, it turns
      every ``tcp://`` rendezvous of their own torch.distributed world into a client of a store that
      nobody serves, and the engine hangs while starting.
    """
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "TORCHELASTIC_USE_AGENT_STORE", *env)}
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *(p for p in paths if p != root)])
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


Wake = Literal["all", "weights", "cache"]


class RolloutEngine(Protocol):
    max_model_len: int
    """Most tokens (prompt + generated) one sequence may hold."""
    copies_in_engine: bool
    """True for engines that are ``InEngineCopy`` too (the resharder then leaves them the last copy)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]: ...

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self, what: Wake = "all") -> None:
        """Resume ``what`` the last sleep released: everything, the weights alone (to take new weights before
        the trainer frees its copy), or the KV cache (and what else generation needs) after them."""

    def shutdown(self) -> None: ...


Enough = Callable[[Sequence[int]], bool]
"""Given the requests finished so far (their indices, in the order they finished), whether to stop the rest."""


class Aborting(Protocol):
    """An engine that stops generating where its caller says (async_rl.chunk_tokens: null; vLLM and SGLang)."""

    def generate_until(self, prompts: Sequence[Sequence[int]], params: SamplingParams, enough: Enough
                       ) -> list[Completion]:
        """One sample per prompt (``params.n`` = 1), as ``generate`` gives them, while ``enough(finished)``, asked
        after every engine step, is false; then the engine aborts the rest, which come back with finish_reason
        "abort" and the tokens and logprobs they had by then."""


class EngineKind(Protocol):
    """An engine class as every rank of its group uses it for a hand-over, whether it drives the engine or
    not: the engine group (megarl.rollout.group) calls nothing else of an engine's module."""

    copies_in_engine: bool

    @staticmethod
    def package(named: list[tuple[str, torch.Tensor]]) -> Any:
        """This rank's part of a message to the engine, which the driver gathers and passes on: CUDA IPC
        handles for an ``InEngineCopy`` engine, a file of engine-layout tensors for a ``FileLoading`` one."""


class InEngineCopy(Protocol):
    """Engines that copy the trainer's tensors into their own parameters (megarl.reshard.handover); every
    ``per_rank`` holds each engine rank's ``package``d part."""

    def attach(self, per_rank: list[Any], key: str) -> None: ...

    def apply(self, round: int = 0) -> None: ...

    def detach(self) -> None: ...

    def checksums(self, per_rank: list[Any]) -> None: ...


class AdapterServing(Protocol):
    """Engines that serve a LoRA adapter over the base weights they loaded (actor.lora.handover: adapter)."""

    def load_adapter(self, path: str | Path) -> None: ...


class FileLoading(Protocol):
    """Engines that load each engine rank's ``package``d file of engine-layout tensors."""

    def load_files(self, paths: Sequence[str]) -> None: ...


class ReceivesWeights(Protocol):
    """Engines on GPUs of their own (async_rl.engine_gpus), whose workers receive each hand-over through the
    hand-over group (megarl.reshard.receiver)."""

    def join_handover(self, plan: bytes, first_gpu: int, host: str, port: int, backend: str, timeout_s: float,
                      dtype: str) -> str: ...

    def receive_weights(self) -> None: ...


def visible_devices_env(devices: list[int] | None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for an engine on ``devices`` (indices among this process's visible devices)."""
    if devices is None:
        return {}
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [parent.split(",")[d] for d in devices] if parent else [str(d) for d in devices]
    return {"CUDA_VISIBLE_DEVICES": ",".join(physical)}
