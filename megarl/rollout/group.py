"""Engine groups: the ranks that share one engine of ``rollout.tensor_parallel`` (R) devices.

The resharding plan chooses which ranks form each engine and which engine rank each holds
(megarl.reshard.planner.place_engines: the most bytes already local, engines inside a node); an engine
runs on its ranks' GPUs. Its engine rank 0, the driver, starts and drives it; every rank of the group
hands over its own engine rank's weights, packaged by the engine's class (``EngineKind.package``: IPC
handles, or a file) without importing any engine module. Those objects travel over a gloo group of the R
ranks, so none of that touches the GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from megarl.reshard.handover import EngineCopy, checksum_message
from megarl.rollout.base import (
    Aborting,
    AdapterServing,
    Completion,
    EngineKind,
    Enough,
    FileLoading,
    InEngineCopy,
    RolloutEngine,
    SamplingParams,
    Wake,
)
from megarl.rollout.failures import end_run, engine_call
from megarl.run.interrupt import terminal_signals_kept_from_children


@dataclass(frozen=True)
class EngineGroup:
    index: int
    """Which engine this rank belongs to."""
    num_groups: int
    size: int
    """R: ranks (devices) per engine."""
    rank_in_group: int
    """This rank's engine rank."""
    members: tuple[int, ...]
    """The engine's global ranks in engine-rank order."""
    group: dist.ProcessGroup | None
    """gloo group of the engine's ranks; None when R is 1."""
    gpus: tuple[int, ...] | None = None
    """Engines on GPUs of their own (async_rl.engine_gpus): the engine's GPUs as the plan numbers them, which on
    its one node are their device indices; ``members`` are then the trainer ranks that share the engine's
    samples, its driver first, and no rank holds an engine rank."""

    @property
    def driver(self) -> bool:
        return self.rank_in_group == 0

    def devices(self) -> list[int] | None:
        """The engine's GPUs as indices among this process's visible devices (None on CPU)."""
        if not torch.cuda.is_available():
            return None
        if self.gpus is not None:
            return list(self.gpus)
        here = torch.cuda.current_device()  # GPU = local rank: members of one node differ as their ranks do
        me = self.members[self.rank_in_group]
        return [here + m - me for m in self.members]

    def share(self, num_prompts: int, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompts of a batch of ``num_prompts`` this engine generates (i, i + number of engines, ...; none off
        its driver) and their sampling: prompt p's j-th sample at params.seed + p * n + j, its place in the whole
        batch, so that no two samples of the batch share a seed, on whichever engines they run; or at
        params.seeds[p] + j where the caller seeds each prompt."""
        mine = list(range(self.index, num_prompts, self.num_groups)) if self.driver else []
        budgets = None if params.budgets is None else [params.budgets[p] for p in mine]
        if params.seeds is not None:  # each prompt's own (partial rollouts: megarl.rollout.inflight)
            return mine, dataclasses.replace(params, seeds=[params.seeds[p] for p in mine], budgets=budgets)
        seeds = None if params.seed is None else [params.seed + p * params.n for p in mine]
        return mine, dataclasses.replace(params, seed=None, seeds=seeds, budgets=budgets)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in engine-rank order on the driver, None elsewhere."""
        if self.group is None:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.driver else None
        dist.gather_object(obj, out, dst=self.members[0], group=self.group)
        return self._engine_order(out) if out is not None else None

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in engine-rank order, on every rank."""
        out: list[Any] = [obj] * self.size
        if self.group is not None:
            dist.all_gather_object(out, obj, group=self.group)
            out = self._engine_order(out)
        return out

    def _engine_order(self, by_group_rank: list[Any]) -> list[Any]:
        """A process group ranks its members by global rank; the engine by engine rank."""
        position = {g: i for i, g in enumerate(sorted(self.members))}
        return [by_group_rank[position[g]] for g in self.members]

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def engine_group(rank: int, engines: list[list[int]], timeout: timedelta) -> EngineGroup:
    """This rank's group among ``engines`` (global ranks in engine-rank order, as the plan places them), its
    collectives waiting up to ``timeout``; every rank must call it (it collectively creates all groups)."""
    size = len(engines[0])
    mine = None
    index = next(i for i, members in enumerate(engines) if rank in members)
    if size > 1:
        for i, members in enumerate(engines):
            created = dist.new_group(sorted(members), backend="gloo", timeout=timeout)
            if i == index:
                mine = created
    members = engines[index]
    return EngineGroup(index=index, num_groups=len(engines), size=size, rank_in_group=members.index(rank),
                       members=tuple(members), group=mine)


def engine_group_apart(rank: int, world: int, engines: list[list[int]], timeout: timedelta) -> EngineGroup:
    """This rank's group when the engines (their plan GPUs in ``engines``) have GPUs of their own: engine e is
    driven by trainer ranks e * m ... (e + 1) * m - 1, m = world / len(engines), its driver first. Every rank must
    call it (it collectively creates all groups)."""
    m = world // len(engines)
    index = rank // m
    mine = None
    for i in range(len(engines)):
        created = dist.new_group(list(range(i * m, (i + 1) * m)), backend="gloo", timeout=timeout) if m > 1 \
            else None
        if i == index:
            mine = created
    return EngineGroup(index=index, num_groups=len(engines), size=m, rank_in_group=rank - index * m,
                       members=tuple(range(index * m, (index + 1) * m)), group=mine, gpus=tuple(engines[index]))


def start_engine(group: EngineGroup, make: Callable[[], RolloutEngine], timeout_s: float) -> RolloutEngine | None:
    """The group's engine, started by its driver (None elsewhere) within ``timeout_s`` like every engine call:
    an engine that hangs while it starts ends the run with an error naming the phase and the deadline."""
    if not group.driver:
        return None
    # Ctrl-C stops the trainer, which stops the engine
    with terminal_signals_kept_from_children(), engine_call("start-up", timeout_s):
        return make()


class GroupEngine:
    """One group's engine as every rank of the group sees it: the driver runs the engine; every rank
    hands over its own engine rank's weights (``attach``/``deliver``)."""

    def __init__(self, group: EngineGroup, engine: RolloutEngine | None, kind: EngineKind,
                 timeout_s: float = 1800.0) -> None:
        """``kind``: the engine's class (every rank packages its part of a hand-over with it)."""
        assert (engine is not None) == group.driver
        self.group, self.engine, self.kind = group, engine, kind
        self.timeout_s = timeout_s

    @property
    def copies_in_engine(self) -> bool:
        return self.kind.copies_in_engine

    def _call(self, phase: str) -> AbstractContextManager[None]:
        return engine_call(phase, self.timeout_s)

    def attach(self, copy: EngineCopy, key: str = "actor") -> None:
        """In-engine hand-over: give the engine this rank's trainer tensors and copy, once."""
        num_sources = max(self.group.all_gather(len(copy.sources)))  # every rank sends as many names
        wires = self.group.gather(self.kind.package(copy.to_wire(key, num_sources)))
        if self.engine is not None:
            assert wires is not None
            with self._call("attach"):
                cast(InEngineCopy, self.engine).attach(wires, key)
        self.group.barrier()

    def checksums(self, num_tensors: int, key: str = "actor") -> torch.Tensor:
        """In-engine hand-over: this rank's engine rank's checksums of the ``num_tensors`` parameters it writes
        (int64 [num_tensors, 2], megarl.reshard.verify), computed inside the engine."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        result = torch.full((num_tensors, 2), -1, dtype=torch.int64, device=device)
        wires = self.group.gather(self.kind.package(checksum_message(key, result)))
        if self.engine is not None:
            assert wires is not None
            with self._call("verification"):
                cast(InEngineCopy, self.engine).checksums(wires)
        self.group.barrier()  # every engine rank has written its rank's result
        return result.cpu()

    def deliver(self, engine_tensors: dict[str, torch.Tensor] | None, round: int = 0) -> None:
        """After every rank's refit (of round ``round``, in-engine): the engine takes the new weights (in-engine
        copy, or files of engine-layout tensors, one per engine rank, written by each rank)."""
        if self.copies_in_engine:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the engine reads what this rank's streams wrote
            self.group.barrier()
            if self.engine is not None:
                with self._call("hand-over"):
                    cast(InEngineCopy, self.engine).apply(round)
            self.group.barrier()  # nobody changes a tensor the engine still reads
            return
        assert engine_tensors is not None
        path = self.kind.package(list(engine_tensors.items()))
        try:
            paths = self.group.gather(path)
            if self.engine is not None:
                assert paths is not None
                with self._call("hand-over"):
                    cast(FileLoading, self.engine).load_files(paths)
            self.group.barrier()  # every file is read before it goes
        finally:
            os.remove(path)

    def join_handover(self, join: Callable[[], None], *args: Any) -> None:
        """Engines apart: this rank joins the hand-over group (``join``) while the driver's engine workers join it
        (``ReceivesWeights.join_handover(*args)``), beside it in a thread: both block until every member is in."""
        self._beside(join, "hand-over group", lambda engine: engine.join_handover(*args))

    def receive(self, send: Callable[[], None]) -> None:
        """Engines apart: this rank sends its part of a hand-over (``send``) while the driver's engine workers
        receive theirs."""
        self._beside(send, "hand-over", lambda engine: engine.receive_weights())

    def _beside(self, here: Callable[[], None], phase: str, engine_side: Callable[[Any], Any]) -> None:
        """``here()`` on this thread and, on the driver, ``engine_side(engine)`` beside it: a vLLM call blocks its
        caller until every worker returns, and the workers wait for this rank's part. An engine that fails while
        ``here()`` still waits for it (a send its dead worker never receives) ends the run at once, naming the
        engine's error, instead of after the group's timeout; an error of ``here()`` ends the run as any other."""
        if self.engine is None:
            here()
            return
        failure: list[BaseException] = []
        here_done = threading.Event()

        def call() -> None:
            try:
                with self._call(phase):
                    engine_side(self.engine)
            except BaseException as err:
                if not here_done.is_set():
                    end_run(str(err))
                failure.append(err)  # raised on this rank's own thread, below

        thread = threading.Thread(target=call, name=f"megarl-engine-{phase}", daemon=True)
        thread.start()
        here()
        here_done.set()
        thread.join()
        if failure:
            raise failure[0]

    def load_adapter(self, path: str | Path | None) -> None:
        """The engine serves the PEFT adapter its driver wrote at ``path`` (None on the other ranks)."""
        if self.engine is not None:
            assert path is not None
            with self._call("hand-over"):
                cast(AdapterServing, self.engine).load_adapter(path)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.engine is None or not prompts:
            return []
        with self._call("generate"):
            return self.engine.generate(prompts, params)

    def generate_until(self, prompts: list[list[int]], params: SamplingParams, enough: Enough) -> list[Completion]:
        if self.engine is None or not prompts:
            return []
        with self._call("generate"):
            return cast(Aborting, self.engine).generate_until(prompts, params, enough)

    def sleep(self) -> None:
        if self.engine is not None:
            with self._call("sleep"):
                self.engine.sleep()

    def wake(self, what: Wake = "all") -> None:
        if self.engine is not None:
            with self._call("wake"):
                self.engine.wake(what)

    def detach(self) -> None:
        """In-engine hand-over: the engine closes its mappings of every rank's trainer tensors (``attach``
        again before the next ``deliver``)."""
        if self.engine is not None:
            with self._call("detach"):
                cast(InEngineCopy, self.engine).detach()
        self.group.barrier()  # no rank frees a tensor the engine still maps

    def shutdown(self) -> None:
        if self.engine is not None:
            with self._call("shutdown"):
                self.engine.shutdown()
