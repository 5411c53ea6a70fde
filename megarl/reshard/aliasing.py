"""rollout.alias_weights: the engine maps the actor's weights instead of holding a copy of them.

An engine parameter that is, byte for byte, one run of a trainer tensor on the same GPU (planner.aliases) can be
a view of the actor's memory: the engine holds no copy of it and a hand-over copies nothing into it (the
optimizer's step writes the engine's weights). The engine opens those views when it loads its model, before it
captures its CUDA graphs, so the graphs read the actor's addresses; the actor's weights then stay on the GPU at
those addresses for the whole run. That pays where the views cover most of the engine's weights (engine TP equal
to trainer TP on one pipeline stage: 89-94% for Llama and Qwen) or where the actor's weights stay anyway
(actor.offload_weights: false). The choice is made once, from the layouts alone, the same on every rank.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.spec import ModelSpec
from megarl.reshard.planner import Plan, aliases, make_plan

if TYPE_CHECKING:
    from megarl.config import Config



class Gathering(Protocol):
    """An engine group as the aliasing needs it (megarl.rollout.group.EngineGroup): its index, and a gather of
    one object from every engine rank onto the group's driver (None elsewhere)."""

    @property
    def index(self) -> int: ...

    def gather(self, obj: Any) -> list[Any] | None: ...


AUTO_SHARE = 0.5
"""alias_weights: auto aliases when at least this share of every engine rank's bytes is the actor's memory."""


def aliased_shares(plan: Plan) -> list[float]:
    """Per GPU: the share of its engine rank's bytes that are views of the actor's tensors."""
    out = []
    for rank, views in enumerate(aliases(plan)):
        shapes = plan.engine_shapes(rank)
        out.append(sum(math.prod(shapes[n]) for n in views) / sum(math.prod(s) for s in shapes.values()))
    return out


def aliases_weights(cfg: Config, spec: ModelSpec, dims: ParallelDims, plan: Plan | None = None) -> float:
    """The share of each engine rank's weights that alias the actor's (the smallest over ranks), 0.0 where
    rollout.alias_weights does not apply; rollout.alias_weights: true where too little can alias is an error.
    ``plan``: the run's hand-over plan (None: one data-parallel replica's, which every replica repeats)."""
    mode, r = cfg.rollout.alias_weights, cfg.rollout.tensor_parallel
    if cfg.rollout.weight_dtype == "fp8":  # FP8 engine layers cannot map bf16 tensors (check_fp8_rollout refuses true)
        return 0.0
    merged = cfg.actor.lora_on() and not cfg.actor.adapter_handover()
    if mode is False or cfg.rollout.engine != "sglang" or merged or cfg.async_rl.mode == "separate":
        # A LoRA actor handing over merged weights W + s B A has no tensor that holds them (one handing over its
        # adapters has: the engine's base weights are its frozen W, and the adapters are never aliased); an engine
        # that generates while the learner updates must not read the weights being updated.
        return 0.0
    if plan is None and (dims.tp * dims.pp) % r == 0:
        plan = make_plan(spec, ParallelDims(tp=dims.tp, pp=dims.pp, dp=1), r, element_size=1,
                         vocab_pad_multiple=cfg.model.vocab_pad_multiple)
    share = min(aliased_shares(plan)) if plan is not None else 0.0
    if mode is True:
        if share < AUTO_SHARE:
            raise UserError(
                f"rollout.alias_weights = true, but the engine's layout does not match the trainer's: rollout."
                f"tensor_parallel = {r}, parallel.tensor_parallel = {dims.tp}, parallel.pipeline_parallel = "
                f"{dims.pp} (the engine's weights could map {share:.0%} of the actor's). Fix: set "
                "rollout.tensor_parallel equal to parallel.tensor_parallel with pipeline_parallel 1, or "
                "rollout.alias_weights: auto.")
        return share
    if share >= AUTO_SHARE or (share > 0 and not cfg.actor.offload_weights):
        return share
    return 0.0


def aliased_views(plan: Plan, rank: int, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This GPU's engine parameters that alias the actor's tensors ``src`` (canonical Megatron names), as views of
    them in the engine's shapes."""
    shapes = plan.engine_shapes(rank)
    out = {}
    for name, (src_name, offset) in aliases(plan)[rank].items():
        flat = src[src_name].view(-1)
        out[name] = flat[offset:offset + math.prod(shapes[name])].view(shapes[name])
    return out


def share_aliases(directory: Path, group: Gathering, kind: Any, views: dict[str, torch.Tensor]) -> Path | None:
    """Every engine rank's views of the actor's tensors, packaged (CUDA IPC handles), in one file in ``directory``
    that the engine's loader reads when it builds its model (megarl.rollout.sglang_loader.AliasingLoader); its path
    on the group's driver, None elsewhere."""
    wires = group.gather(kind.package(list(views.items())))
    if wires is None:
        return None
    path = directory / f"engine_{group.index}.aliases"
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        pickle.dump(wires, f)
    partial.replace(path)
    return path
