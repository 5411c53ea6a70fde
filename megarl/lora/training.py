"""A LoRA actor in training (actor.lora): ``LoraAdapters`` is what MegatronModel is given as its adapters
(megarl.models.adapters), so that the model knows no LoRA and LoRA's code stays here.

- ``install``: adapters on this rank's chunks after the HF weights load and before DDP, base weights frozen, so
  that DDP's gradient buffers and the optimizer hold the adapters only; each adapter gets a ``merged`` buffer of
  its base weight's shape (a module buffer: it leaves the device with the weights, megarl.memory.offload).
- ``merged``: what the resharder reads: the canonical parameters with every adapted weight replaced by its
  ``merged`` buffer; ``refresh_merged`` writes W + s B A into those buffers before each hand-over.
- ``state_part``: the adapters and their optimizer state in a checkpoint (megarl.lora.checkpoint).
- ``adapter_params_per_rank``: the adapters' parameter count on the busiest GPU, for the memory plan.

The reference policy of a LoRA actor is the actor under ``adapters_disabled`` (megarl.lora.layers): no second copy
of the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from megarl.config.lora import LoraConfig
from megarl.lora.checkpoint import AdapterState
from megarl.lora.layers import LoraAdapter, adapters_disabled, apply_lora, dropout_on
from megarl.models.gpt import unwrap
from megarl.models.spec import ModelSpec
from megarl.models.state import StatePart


class LoraAdapters:
    """actor.lora's adapters for one MegatronModel (megarl.models.adapters.Adapters); ``seed`` draws A's init."""

    def __init__(self, cfg: LoraConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.chunks: Sequence[torch.nn.Module] = ()
        self.offsets: Sequence[int] = ()

    def install(self, chunks: Sequence[torch.nn.Module], layer_offsets: Sequence[int]) -> None:
        self.chunks, self.offsets = chunks, layer_offsets
        install(chunks, self.cfg, self.seed)

    def params(self) -> dict[str, torch.nn.Parameter]:
        return adapter_params(self.chunks, self.offsets)

    def merged(self, canonical: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        return handover_params(canonical, self.chunks)

    def refresh_merged(self) -> None:
        refresh_merged(self.chunks)

    def disabled(self) -> AbstractContextManager[None]:
        return adapters_disabled(self.chunks)

    def dropout(self) -> AbstractContextManager[None]:
        return dropout_on(self.chunks)

    def state_part(self) -> StatePart:
        return AdapterState(self.cfg, self.params, self.refresh_merged)


def install(chunks: Sequence[torch.nn.Module], cfg: LoraConfig, seed: int) -> list[torch.nn.Parameter]:
    """Adapters on ``chunks`` (unwrapped, weights loaded), the base frozen; the adapters' parameters. With
    ``handover: merged`` each adapter gets its ``merged`` buffer; ``adapter`` hands over no weights and needs none."""
    params = apply_lora(chunks, cfg, seed)
    for chunk in chunks:
        embedding = getattr(unwrap(chunk), "embedding", None)
        if embedding is not None:  # the first pipeline stage
            embedding.register_forward_hook(_require_grad)
    if cfg.handover == "merged":
        for base, adapter in adapted(chunks):
            weight: torch.Tensor = base.weight  # type: ignore[assignment]
            adapter.register_buffer("merged", torch.empty_like(weight, requires_grad=False), persistent=False)
        refresh_merged(chunks)
    return params


def adapter_params(chunks: Sequence[torch.nn.Module], offsets: Sequence[int]) -> dict[str, torch.nn.Parameter]:
    """This rank's adapter factors by canonical name ("decoder.layers.5.mlp.linear_fc1.lora.A", global layer
    numbers: chunk ``vp``'s first layer is ``offsets[vp]``)."""
    out = {}
    for chunk, offset in zip(chunks, offsets, strict=True):
        for name, p in unwrap(chunk).named_parameters():
            if ".lora." in name:
                _, _, number, rest = name.split(".", 3)  # decoder.layers.N.rest
                out[f"decoder.layers.{int(number) + offset}.{rest}"] = p
    return out


def adapted(chunks: Sequence[torch.nn.Module]) -> list[tuple[torch.nn.Module, LoraAdapter]]:
    """(base linear layer, its adapter) for every adapted layer of ``chunks``."""
    return [(m, m.lora) for chunk in chunks for m in unwrap(chunk).modules()  # type: ignore[misc]
            if isinstance(getattr(m, "lora", None), LoraAdapter)]


def _require_grad(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """The frozen embedding's output as a tensor that requires grad. Activation recompute (Megatron's reentrant
    checkpoint) runs a layer's backward only when an input requires grad; with the whole base frozen none would,
    and the adapters inside would get no gradient at all."""
    return output.requires_grad_(True) if not output.requires_grad else output


@torch.no_grad()
def refresh_merged(chunks: Sequence[torch.nn.Module]) -> None:
    """W + s B A into every adapter's ``merged`` buffer (in place: the resharder keeps its address)."""
    for base, adapter in adapted(chunks):
        merged: torch.Tensor | None = getattr(adapter, "merged", None)
        if merged is not None:
            torch.add(base.weight, adapter.weight_delta(), out=merged)  # type: ignore[arg-type]


def handover_params(canonical: dict[str, torch.nn.Parameter], chunks: Sequence[torch.nn.Module]
                    ) -> dict[str, torch.Tensor]:
    """``canonical`` (name -> this rank's parameter) as tensors, each adapted weight replaced by W + s B A: its
    ``merged`` buffer, or (handover: adapter, which keeps none) a new tensor, for a checkpoint to write."""
    by_weight = {id(base.weight): adapter.merged if hasattr(adapter, "merged") else
                 (base.weight + adapter.weight_delta()).detach()  # type: ignore[operator]
                 for base, adapter in adapted(chunks)}
    return {name: by_weight.get(id(p), p.data) for name, p in canonical.items()}  # type: ignore[misc]


def adapter_params_per_rank(spec: ModelSpec, cfg: LoraConfig, tp: int, pp: int) -> int:
    """Adapter parameters on a GPU of the busiest pipeline stage: per layer and target, A [r, in] and B [out, r]
    with the base's split dimension split over TP (B's rows for qkv and fc1, A's columns for o and fc2)."""
    if cfg.rank == 0:
        return 0
    r, shapes = cfg.rank, _shapes(spec)
    column = {"qkv", "fc1"}  # B's rows split over TP; row-parallel o and fc2: A's columns
    per_target = {t: r * i + o * r // tp if t in column else r * i // tp + o * r for t, (i, o) in shapes.items()}
    return -(-spec.num_layers // pp) * sum(per_target[t] for t in cfg.target_modules)


class BaseModel:
    """The reference model of a LoRA actor: the actor itself, scoring with its adapters off (Learner.reference)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.replay = actor.replay

    def score(self, *args: Any, **kwargs: Any) -> Any:
        with self.actor.base_model():
            return self.actor.score(*args, **kwargs)


def _shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each target's whole weight."""
    h, q, kv = spec.hidden_size, spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    ffn = spec.intermediate_size
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "fc1": (h, 2 * ffn), "fc2": (ffn, h)}


def merged_params_per_rank(spec: ModelSpec, cfg: LoraConfig, tp: int, pp: int) -> int:
    """Elements of the ``merged`` buffers (the hand-over's W + s B A) on a GPU of the busiest pipeline stage."""
    if cfg.rank == 0 or cfg.handover == "adapter":
        return 0
    shapes = _shapes(spec)
    return -(-spec.num_layers // pp) * sum(shapes[t][0] * shapes[t][1] // tp for t in cfg.target_modules)
