"""The weight sync: the hand-over's plan (which also places the engines), the actor's memory the engines map
(rollout.alias_weights), the resharder and its engine-layout tensors, and the hand-over of every step."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ProcessGroup

from megarl.config import Config, run_dir
from megarl.distributed.parallel import ParallelGroups
from megarl.distributed.ports import free_port
from megarl.distributed.rank0 import from_rank0
from megarl.loop.learner import Learner
from megarl.loop.rollout_manager import RolloutManager
from megarl.loop.timing import PartTimes
from megarl.lora.handover import AdapterHandover
from megarl.models.gpt import DTYPES
from megarl.models.spec import ModelSpec
from megarl.reshard.aliasing import aliased_views, aliases_weights, share_aliases
from megarl.reshard.executor import Resharder, engine_tensor_allocations
from megarl.reshard.handover_group import handover_group
from megarl.reshard.planner import LinkModel, make_plan
from megarl.reshard.predict import describe_plan
from megarl.rollout.group import EngineGroup, GroupEngine, engine_group, engine_group_apart


class WeightSync:
    def __init__(self, cfg: Config, groups: ParallelGroups, spec: ModelSpec, times: PartTimes) -> None:
        """The plan, made first: it places the engines (which GPUs form each, most bytes already local)."""
        self.cfg, self.groups, self.times = cfg, groups, times
        self.links = LinkModel(nvlink_gbps=cfg.parallel.nvlink_gbps, network_gbps=cfg.parallel.network_gbps)
        self.apart = cfg.async_rl.engine_gpus
        """Engines on GPUs of their own: the plan numbers them after the trainer's, on the same node."""
        self.plan = make_plan(spec, groups.dims, cfg.rollout.tensor_parallel,
                              gpus_per_node=cfg.parallel.gpus_per_node
                              or int(os.environ.get("LOCAL_WORLD_SIZE", groups.dims.world_size)) + self.apart,
                              element_size=torch.finfo(DTYPES[cfg.model.dtype]).bits // 8,
                              bucket_bytes=cfg.rollout.reshard_bucket_mb * 2**20,
                              vocab_pad_multiple=cfg.model.vocab_pad_multiple, links=self.links,
                              engine_gpus=self.apart, weight_dtype=cfg.rollout.weight_dtype,
                              fp8_block=cfg.rollout.fp8_block)
        self.aliased = aliases_weights(cfg, spec, groups.dims, self.plan)
        """The share of the engine's weights it maps from the actor's memory (0: none)."""
        self.weights_leave = cfg.actor.offload_weights and not self.aliased  # the engine then holds the only copy
        self.views: dict[str, torch.Tensor] = {}
        self.adapters: AdapterHandover | None = None
        self.engine_tensors: dict[str, torch.Tensor] | None = None
        self.resharder: Resharder | Any = None
        self.attached = False  # an in-engine hand-over maps the actor's tensors (megarl.reshard.handover)
        self.num_handovers = 0

    def describe(self) -> None:
        if self.groups.rank == 0:
            plan = describe_plan(self.plan, predict=torch.cuda.is_available(), links=self.links)
            print(f"megarl: hand-over plan: {plan}", flush=True)
            if self.aliased:
                print(f"megarl: the engine maps {self.aliased:.0%} of its weights from the actor's memory "
                      "(rollout.alias_weights): a hand-over copies only the rest, and the actor's weights stay on "
                      "the GPU during rollout", flush=True)

    def engine_group(self) -> EngineGroup:
        """This rank's engine group, as the plan placed it."""
        if self.apart:
            return engine_group_apart(self.groups.rank, self.groups.dims.world_size, self.plan.engines(),
                                      self.cfg.host_group_timeout())
        return engine_group(self.groups.rank, self.plan.engines(), self.cfg.host_group_timeout())

    def share_aliases(self, learner: Learner, group: EngineGroup, kind: Any) -> Path | None:
        """The file of the actor's tensors that this group's engine maps, for its loader (None: none)."""
        if not self.aliased:
            return None
        self.views = aliased_views(self.plan, self.groups.rank, self._sources(learner))
        return share_aliases(run_dir(self.cfg), group, kind, self.views)

    def _sources(self, learner: Learner) -> dict[str, torch.Tensor]:
        """The actor's tensors the engine's weights are: the merged W + s B A with LoRA handed over merged, the frozen
        base W when the engine serves the adapters itself (handover: adapter)."""
        return learner.actor.base_params() if self.cfg.actor.adapter_handover() else learner.actor.named_params()

    def base_copy(self, engine: Any) -> bool:
        """handover: adapter into an engine that copies in-engine (SGLang): every hand-over also copies the base
        weights W from the actor, as a full-weight hand-over does. SGLang's sleep discards its weights (no CPU
        backup), and with rollout.alias_weights its loader leaves every parameter that is not aliased unwritten."""
        return self.adapters is not None and engine.copies_in_engine

    def connect(self, learner: Learner, rollout: RolloutManager) -> None:
        """With the engine started: the resharder between the actor's tensors and the engine's, then the first
        hand-over."""
        cfg = self.cfg
        if cfg.actor.adapter_handover() and cfg.actor.lora is not None:
            self.adapters = AdapterHandover(learner.actor, cfg.actor.lora, rollout.engine, run_dir(cfg))
        if self.weights_leave:
            rollout.sleep()  # the hand-over needs the actor's weights back on the GPU, next to the engine's
        learner.hold("handover")
        if self.apart:
            if self.adapters is None:  # adapters travel as files, without the group
                self.resharder = Resharder(self.plan, self.groups.rank, learner.actor.named_params(), {},
                                           group=self._join_handover(rollout.engine), device=self.groups.device)
            self.push(learner, rollout)
            return
        # An engine that copies in-engine reads the actor's tensors itself; others get engine-layout tensors.
        in_engine = rollout.engine.copies_in_engine
        self.engine_tensors = None if in_engine else self._allocate_engine_tensors()
        self.resharder = Resharder(self.plan, self.groups.rank, self._sources(learner), self.engine_tensors,
                                   in_engine=in_engine, landing_bytes=cfg.rollout.landing_buffer_mb * 2**20,
                                   aliased=set(self.views))
        if self.groups.rank == 0 and self.resharder.num_rounds > 1:
            print(f"megarl: each hand-over lands what other GPUs send in {self.resharder.num_rounds} rounds, one "
                  f"engine call each (rollout.landing_buffer_mb = {cfg.rollout.landing_buffer_mb})", flush=True)
        if self.adapters is not None and self.engine_tensors is not None:  # no engine-layout copy of the weights
            self.resharder.release()
            self.engine_tensors.clear()
        self.push(learner, rollout)

    def _join_handover(self, engine: GroupEngine) -> ProcessGroup:
        """Engines apart: the trainer's ranks and the engines' workers join one group, numbered as the plan numbers
        their GPUs (megarl.reshard.handover_group), meeting at a port rank 0 picks."""
        port = from_rank0(free_port, self.groups.rank)
        host, timeout_s = os.environ.get("MASTER_ADDR", "127.0.0.1"), self.cfg.rollout.timeout_minutes * 60
        device = self.groups.device if self.groups.device.type == "cuda" else None
        backend = "nccl" if device is not None else "gloo"
        joined: list[ProcessGroup] = []
        assert engine.group.gpus is not None
        engine.join_handover(
            lambda: joined.append(handover_group(self.groups.rank, self.plan.num_gpus, host, port, backend=backend,
                                                 timeout_s=timeout_s, device=device)),
            pickle.dumps(self.plan), engine.group.gpus[0], host, port, backend, timeout_s, self.cfg.model.dtype)
        return joined[0]

    def _allocate_engine_tensors(self) -> dict[str, torch.Tensor]:
        return engine_tensor_allocations(self.plan, self.groups.rank, DTYPES[self.cfg.model.dtype],
                                         self.groups.device)

    def push(self, learner: Learner, rollout: RolloutManager) -> None:
        """Reshard the actor's current weights into the engine's layout and hand them over; the engine is awake
        after it. The engine's weights wake first, next to the actor's; with actor.offload_weights the actor's then
        leave the GPU (the resharder and the engine let go of their addresses), and only then does the engine's KV
        cache wake, in the room they leave."""
        engine, timed = rollout.engine, self.times.timed
        if rollout.state == "asleep":
            # the update's state (optimizer, grads) leaves, the actor's weights come back
            with timed("handover/hold"):
                learner.hold("handover")
            with timed("handover/wake_weights"):
                rollout.wake("weights")
        with timed("handover/attach"):
            if engine.copies_in_engine and not self.attached:
                engine.attach(self.resharder.engine_copy())  # the actor's tensors where they are now
                self.attached = True
            if self.engine_tensors is not None and not self.engine_tensors and self.adapters is None:  # freed
                self.engine_tensors.update(self._allocate_engine_tensors())
        with timed("handover/copy"):
            if self.adapters is not None:  # LoRA, handover: adapter: the new adapters (the base W never changes)
                self.adapters()
            if self.adapters is None or self.base_copy(engine):
                learner.actor.refresh_merged()  # LoRA handed over merged: the engine gets W + s B A
                if self.apart:  # the engines' workers receive while this rank sends
                    engine.receive(self.resharder.refit)
                else:
                    for round in range(self.resharder.num_rounds):  # the landing buffer holds one round (in-engine)
                        self.resharder.refit(round)
                        engine.deliver(self.engine_tensors, round)
        every = self.cfg.rollout.verify_every
        if every and self.num_handovers % every == 0 and (self.adapters is None or self.base_copy(engine)):
            with timed("handover/verify"):
                self.resharder.verify(engine, self.num_handovers)
        self.num_handovers += 1
        with timed("handover/release"):  # the actor's weights leave (actor.offload_weights), caches go back
            if self.weights_leave:
                if self.attached:
                    engine.detach()
                    self.attached = False
                self.resharder.release()
                if self.engine_tensors is not None:
                    self.engine_tensors.clear()  # the engine has loaded them: no copy of the weights stays
            if self.weights_leave or rollout.state == "weights":
                learner.hold("generate")  # also with the actor's weights kept: the update's cached memory must go
        if rollout.state == "weights":
            with timed("handover/wake_cache"):
                rollout.wake("cache")
        rollout.state = "awake"
