"""The engine's side of a hand-over to engines on GPUs of their own (async_rl.engine_gpus), run inside an engine
worker process that has joined the hand-over group as its plan GPU: it receives exactly the bytes its engine rank
lacks.

The trainer sends the plan itself (pickled: the worker runs megarl's own code, and a plan rebuilt there could
differ from the trainer's in a way no one would see), so both sides execute the same buckets in the same order.
Where every engine tensor has a parameter of its shape and dtype (engines on GPUs) the bytes land in the
parameters themselves: no second copy of the weights on the engine's GPU. Otherwise (vLLM's CPU backend repacks
its linear weights) they land in tensors of the engine layout, which the engine's loader then reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from megarl.reshard.executor import Resharder, engine_tensor_allocations
from megarl.reshard.planner import Plan


class EngineReceiver:
    def __init__(self, plan: Plan, gpu: int, group: dist.ProcessGroup, *, params: Mapping[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device) -> None:
        """Plan GPU ``gpu``'s side of every hand-over over ``group`` (megarl.reshard.handover_group). ``params``:
        the engine's parameters by engine-layout name (received into where they all match)."""
        shapes = plan.engine_shapes(gpu)
        if not shapes:
            raise ValueError(f"plan GPU {gpu} holds no engine rank: engines start at GPU {plan.dims.world_size}")
        self.in_place = all(name in params and tuple(params[name].shape) == tuple(shape)
                            and params[name].dtype == dtype for name, shape in shapes.items())
        self.tensors = {name: params[name] for name in shapes} if self.in_place else \
            engine_tensor_allocations(plan, gpu, dtype, device)
        self.resharder = Resharder(plan, gpu, {}, self.tensors, group=group, device=device, dtype=dtype)

    @torch.no_grad()
    def receive(self) -> dict[str, torch.Tensor]:
        """One hand-over: this engine rank's tensors, in the parameters themselves where ``in_place``."""
        self.resharder.refit()
        if self.resharder.device.type == "cuda":
            torch.cuda.synchronize(self.resharder.device)  # the engine's next kernels read them
        return self.tensors
