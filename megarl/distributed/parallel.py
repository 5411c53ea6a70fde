"""Trainer parallelism: the TP x PP x DP mesh, rank coordinates, and megatron-core process groups.

MoE experts are split over ``ep`` expert-parallel ranks carved out of DP (Megatron's expert mesh, with expert
TP equal to TP): a rank's expert-parallel rank is ``dp % ep``, and it holds experts
[ep_rank * E / ep, (ep_rank + 1) * E / ep) of every MoE layer.

This is the only module that touches megatron's global ``parallel_state``; everything else
receives a ``ParallelGroups`` and passes its groups explicitly.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.platform import Platform

_MEGATRON_ORDER = {"tp-dp-pp": "tp-cp-ep-dp-pp", "tp-pp-dp": "tp-cp-ep-pp-dp"}


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Sizes of the trainer mesh. ``order`` lists axes from fastest- to slowest-varying rank."""

    tp: int
    pp: int
    dp: int
    vpp: int | None = None
    order: str = "tp-dp-pp"
    ep: int = 1
    """Expert-parallel ranks (MoE); divides dp."""

    def __post_init__(self) -> None:
        assert self.tp >= 1 and self.pp >= 1 and self.dp >= 1, self
        assert self.order in _MEGATRON_ORDER, self.order
        assert self.ep >= 1 and self.dp % self.ep == 0, self
        assert self.ep == 1 or self.order == "tp-dp-pp", "expert parallelism needs the tp-dp-pp rank order"

    def ep_rank(self, rank: int) -> int:
        """The expert-parallel rank of a global rank."""
        return self.coords(rank)["dp"] % self.ep

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def _axes(self) -> list[tuple[str, int]]:
        sizes = {"tp": self.tp, "dp": self.dp, "pp": self.pp}
        return [(axis, sizes[axis]) for axis in self.order.split("-")]

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates {"tp", "dp", "pp"} of a global rank."""
        assert 0 <= rank < self.world_size, rank
        out = {}
        for axis, size in self._axes():
            out[axis] = rank % size
            rank //= size
        return out

    def rank(self, *, tp: int, dp: int, pp: int) -> int:
        """Global rank at the given mesh coordinates."""
        coords = {"tp": tp, "dp": dp, "pp": pp}
        rank, stride = 0, 1
        for axis, size in self._axes():
            assert 0 <= coords[axis] < size, (axis, coords[axis], size)
            rank += coords[axis] * stride
            stride *= size
        return rank


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the mesh and the process groups it communicates over."""

    dims: ParallelDims
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    world_group: dist.ProcessGroup
    ep_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def device(self) -> torch.device:
        """Where tensors for these groups' collectives must live (NCCL takes CUDA tensors only)."""
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(platform: Platform, timeout_minutes: int = 30) -> None:
    """Join the torchrun job (env:// rendezvous) once per process; a hung collective times out. A world of one
    that no launcher gave a port (megarl.loop.bootstrap.standalone_env) meets in its own memory: a port picked
    free and bound later can be taken in between by another process on a busy host."""
    if dist.is_initialized():
        return
    timeout, device_id = datetime.timedelta(minutes=timeout_minutes), platform.device if platform.is_cuda else None
    if os.environ.get("WORLD_SIZE") == "1" and "MASTER_PORT" not in os.environ:
        dist.init_process_group(backend=platform.backend, timeout=timeout, device_id=device_id,
                                store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend=platform.backend, timeout=timeout, device_id=device_id)


def init_model_parallel(dims: ParallelDims, timeout_minutes: int = 30) -> ParallelGroups:
    """Create megatron-core's TP/PP/DP groups for ``dims`` and return them explicitly."""
    from megatron.core import parallel_state as ps

    assert dist.is_initialized() and dist.get_world_size() == dims.world_size, (
        f"world size {dist.get_world_size()} != {dims}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        expert_model_parallel_size=dims.ep,
        distributed_timeout_minutes=timeout_minutes,
        order=_MEGATRON_ORDER[dims.order],
    )
    rank = dist.get_rank()
    groups = ParallelGroups(
        dims=dims,
        rank=rank,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        world_group=dist.group.WORLD,  # type: ignore[arg-type]
        ep_rank=ps.get_expert_model_parallel_rank(),
    )
    coords = dims.coords(rank)
    assert (coords["tp"], coords["pp"], coords["dp"], dims.ep_rank(rank)) == (
        groups.tp_rank, groups.pp_rank, groups.dp_rank, groups.ep_rank), (
        "megatron's rank order disagrees with ParallelDims", coords, groups)
    return groups


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def shutdown_distributed() -> None:
    """End of a run that every rank reaches: release the process groups (NCCL warns at exit otherwise)."""
    if dist.is_initialized():
        destroy_model_parallel()
        dist.destroy_process_group()


def model_parallel_seed(seed: int) -> None:
    """Seed torch and megatron's per-TP-rank RNG tracker (dropout, init) reproducibly. Each pipeline stage starts
    from seed + 100 * its rank, as Megatron's own initialize does: stage 0 as without PP, and the stages' dropout
    masks (actor.lora.dropout) their own, not copies of one another's."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        seed += 100 * ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
