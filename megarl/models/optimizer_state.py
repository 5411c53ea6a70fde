"""A Megatron optimizer's state as checkpoints write and read it: per parameter, the fp32 master weights and Adam's
moments (``STATE_KEYS``) where this rank keeps them, Adam's step count, the LR schedule and the loss scaler; and the
file form of such state (flat ranges of each parameter with their offsets), shared by the weights' optimizer and a
LoRA actor's adapters."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megarl.errors import UserError

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
Slots = dict[str, tuple[int, dict[str, torch.Tensor]]]
"""By parameter name: the offset of this rank's part in the flattened parameter, and its live state tensors."""


class OptimizerState:
    """The state of ``optimizer`` (Megatron's, possibly chained) with its LR ``scheduler``; ``params``: the model's
    trainable-or-frozen base parameters by canonical name, the default of ``slots``."""

    def __init__(self, optimizer: Any, scheduler: Any, params: dict[str, torch.nn.Parameter],
                 updates_per_step: int = 1) -> None:
        self.optimizer, self.scheduler, self.params = optimizer, scheduler, params
        self.updates_per_step = updates_per_step
        """Optimizer steps per RL step, the unit of the scheduler's count."""
        self.inner = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        """The Megatron optimizers (several when chained, e.g. one per virtual pipeline chunk)."""

    @property
    def distributed(self) -> bool:
        """Whether each DP rank holds only its own range of the state (the distributed optimizer)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        return any(isinstance(opt, DistributedOptimizer) for opt in self.inner)

    def slots(self, params: dict[str, torch.nn.Parameter] | None = None) -> Slots:
        """Where this rank keeps each of ``params``' state (the base parameters if None)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        slots: Slots = {}
        for opt in self.inner:
            for name, p in (self.params if params is None else params).items():
                if isinstance(opt, DistributedOptimizer):
                    # Each DP rank owns one contiguous range of every bucket, so at most one range of a parameter.
                    if p in opt.model_param_group_index_map:
                        start = opt._get_model_param_range_map(p)["param"].start
                        slots[name] = (start, opt._get_main_param_and_optimizer_states(p))
                    continue
                main = getattr(p, "main_param", None)
                main = p if main is None else main  # fp32 weights are their own master copy
                if main in opt.optimizer.state:
                    slots[name] = (0, {"param": main, **opt.optimizer.state[main]})
        return slots

    def common(self) -> dict[str, Any]:
        """What every rank shares: Adam's step count, the LR schedule, the loss scaler."""
        scaler = getattr(self.inner[0], "grad_scaler", None)
        return {"step": self._step(), "scheduler": self.scheduler.state_dict(),
                "grad_scaler": None if scaler is None else scaler.state_dict(),
                "updates_per_step": self.updates_per_step}

    def load_common(self, common: dict[str, Any]) -> None:
        """The checkpoint's state. The schedule goes on from the same RL step: a resume that changes the optimizer
        steps per RL step (checkpoint.allow_changes of the mini-batch size or the epochs) would otherwise put it at
        the checkpoint's count of optimizer steps, and a run halving them found its decay over at once."""
        self._set_step(common["step"])
        self.scheduler.load_state_dict(common["scheduler"])
        saved = common.get("updates_per_step", self.updates_per_step)
        if saved != self.updates_per_step:
            done = self.scheduler.num_steps
            self.scheduler.num_steps = 0
            self.scheduler.step(increment=round(done * self.updates_per_step / saved))
        if common["grad_scaler"] is not None:
            for opt in self.inner:
                opt.grad_scaler.load_state_dict(common["grad_scaler"])

    def allocate(self) -> None:
        """One zero-gradient step of the inner optimizers, so that the state tensors a checkpoint overwrites exist.

        It moves the master weights by weight decay; every one of them is then overwritten.
        """
        for opt in self.inner:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            opt.optimizer.step()
            opt.optimizer.zero_grad()

    def _step(self) -> int:
        # torch's Adam counts steps per parameter, TE's and apex's FusedAdam per parameter group.
        inner = [opt.optimizer for opt in self.inner]
        steps = {int(g["step"]) for o in inner for g in o.param_groups if "step" in g}
        steps |= {int(s["step"]) for o in inner for s in o.state.values() if "step" in s}
        assert len(steps) == 1, steps
        return steps.pop()

    def _set_step(self, step: int) -> None:
        for opt in self.inner:
            for group in opt.optimizer.param_groups:
                if "step" in group:
                    group["step"] = step
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"].fill_(step)
                elif "step" in state:
                    state["step"] = step


def flat_state(slots: Slots, shapes: dict[str, torch.Size], clone: bool = False
               ) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The tensors ("NAME/KEY": this rank's flat range) and offsets (NAME -> [start, *shape]) a state file holds, for
    the parameters of ``slots`` among ``shapes``. ``clone``: copies even on the CPU (in float32 the master weights
    are the parameters themselves, which one file cannot hold twice)."""
    tensors, offsets = {}, {}
    for name, (start, live) in slots.items():
        if name not in shapes:
            continue
        for key in STATE_KEYS:
            flat = live[key].detach().reshape(-1).cpu()
            tensors[f"{name}/{key}"] = flat.clone() if clone else flat.contiguous()
        offsets[name] = [start, *shapes[name]]
    return tensors, offsets


def saved_state(directory: Path, files: str = "tp*_pp*_dp*.safetensors"
                ) -> Callable[[str], Callable[[int, str], torch.Tensor]]:
    """of(key)(tp_rank, name): the saved state ``key`` of one TP shard of a parameter, joined from its DP ranges
    (the ``files`` of ``directory``: the optimizer's, or a LoRA actor's rank files)."""
    ranges: dict[tuple[int, str], list[tuple[int, Any]]] = defaultdict(list)
    shapes: dict[tuple[int, str], list[int]] = {}
    for path in sorted(directory.glob(files)):
        try:
            handle = safe_open(str(path), framework="pt")
            meta = handle.metadata()
            tp_rank, offsets = int(meta["tp_rank"]), json.loads(meta["offsets"])
        except (SafetensorError, OSError, KeyError, ValueError) as err:
            raise UserError(f"optimizer state `{path}` is unreadable ({err}). The checkpoint is damaged; resume "
                            "from another step_* directory or start anew in another checkpoint.dir.") from None
        for name, (start, *shape) in offsets.items():
            ranges[tp_rank, name].append((start, handle))
            shapes[tp_rank, name] = shape

    def of(key: str) -> Callable[[int, str], torch.Tensor]:
        def get(tp_rank: int, name: str) -> torch.Tensor:
            parts = sorted(ranges[tp_rank, name], key=lambda part: part[0])
            flat = [handle.get_tensor(f"{name}/{key}") for _, handle in parts]
            ends = [start + t.numel() for (start, _), t in zip(parts, flat, strict=True)]
            shape = shapes.get((tp_rank, name), [-1])
            if not parts or [start for start, _ in parts] != [0, *ends[:-1]] or ends[-1] != math.prod(shape):
                raise UserError(f"{directory} lacks part of the optimizer state of `{name}` (TP rank {tp_rank}). "
                                "The checkpoint is damaged; resume from another step_* directory or start a "
                                "new run in another checkpoint.dir.")
            return torch.cat(flat).view(shape)

        return get

    return of
