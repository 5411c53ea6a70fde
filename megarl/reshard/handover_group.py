"""The hand-over's process group when engines run on GPUs of their own, in processes outside the trainer's world.

The trainer's ranks keep their torchrun world (megatron's groups live there); the engine workers are not in it.
Both join one more group, numbered as the plan numbers its GPUs (``make_plan(..., engine_gpus=E)``): the trainer's
world ranks 0..W-1, then engine GPUs W..W+E-1. ``Resharder(..., group=handover_group(...))`` then moves each
engine GPU exactly its bytes over it (NCCL between GPUs, gloo on CPU).

torch registers only groups carved out of a process's own world (``new_group``), and P2P operations need a
registered group, so this builds the group with c10d's own helper and registers its ranks, as SGLang's
``init_weights_update_group`` does; ``tests/test_reshard.py`` runs a refit through it, which a change in torch's
private API would fail. The registered ranks are the group's own: ``dist.get_rank(group)`` is not meaningful in a
process that has a world of its own, and the Resharder never asks it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megarl.errors import UserError

_GRACE_S = 10.0
"""How much longer than rank 0 the other members wait for its verdict (go, or who is missing)."""


class HandoverGroupTimeout(UserError):
    """Not every member joined the hand-over group in time: named, instead of a push that hangs."""

    on_every_rank = False  # each member saw its own part: rank 0 may be the one that is gone


def handover_group(rank: int, size: int, host: str, port: int, *, backend: str, timeout_s: float,
                   device: torch.device | None = None, name: str = "megarl_handover") -> dist.ProcessGroup:
    """Join the group of ``size`` members as ``rank`` (the plan's GPU number), meeting over a TCP store at
    ``host:port`` that rank 0 serves. Rank 0 waits up to ``timeout_s`` for every member, then tells them all to go
    on or which members are missing; every member then raises HandoverGroupTimeout naming them (the others wait
    a little longer than rank 0 for its verdict, and name rank 0 if it never comes). ``device``: where the group's
    first collective runs (None: the CPU, for gloo), which makes every member's communicator before this returns.
    The group's collectives wait up to ``timeout_s`` too."""
    timeout = timedelta(seconds=timeout_s)
    where = f"the weight hand-over group ({size} members, meeting at {host}:{port})"
    try:
        store = dist.TCPStore(host, port, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except dist.DistError as err:
        if rank == 0:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise HandoverGroupTimeout(f"{where}: member 0 could not serve the meeting point ({reason}). Another "
                                       f"process may hold port {port}: start again (the port is chosen afresh) or "
                                       "free it.") from err
        raise HandoverGroupTimeout(f"{where}: member {rank} could not reach member 0 (the trainer's rank 0, "
                                   f"which serves the meeting point) within {timeout_s:.0f} s ({type(err).__name__})"
                                   ". See the trainer's log for why it is not there.") from err
    try:
        verdict = _meet(store, rank, size, name, timeout_s)
    except dist.DistError as err:
        raise HandoverGroupTimeout(f"{where}: member {rank} lost member 0's meeting point before it said who had "
                                   f"joined ({type(err).__name__}). See the trainer's log for why it stopped.") from err
    if verdict is None:
        raise HandoverGroupTimeout(f"{where}: member {rank} heard nothing from member 0 within "
                                   f"{timeout_s + _GRACE_S:.0f} s. See the trainer's log for why it stopped.")
    if verdict:
        raise HandoverGroupTimeout(
            f"{where}: member(s) {verdict} did not join within {timeout_s:.0f} s. Each engine worker joins once its "
            "engine has started: see the engine workers' logs for the one that did not (its start may have failed, "
            "or its GPU may be taken), or give it longer if engines start slowly here.")
    # A world bound to a device (megarl's on CUDA) would make NCCL split this group out of the trainer's
    # communicator, which the engine workers are not in: their first collective would wait forever.
    world = c10d._get_default_group() if dist.is_initialized() else None
    bound = world.bound_device_id if world is not None else None
    if world is not None:
        world.bound_device_id = None
    try:
        group, _ = c10d._new_process_group_helper(size, rank, [], backend, dist.PrefixStore(name, store),
                                                  group_name=c10d.GroupName(name), timeout=timeout)
    finally:
        if world is not None:
            world.bound_device_id = bound
    c10d._world.pg_group_ranks[group] = {r: r for r in range(size)}
    # Communicators are made at a group's first collective: make them now, where a failure is this function's.
    dist.all_reduce(torch.zeros(1, device=device or torch.device("cpu")), group=group)
    return group


def _meet(store: dist.Store, rank: int, size: int, name: str, timeout_s: float) -> str | None:
    """Rank 0's verdict: "" (every member joined), the missing members' numbers, or None (no verdict in time)."""
    store.set(f"{name}/joined/{rank}", "1")
    verdict_key = f"{name}/verdict"
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        while missing := [r for r in range(size) if not store.check([f"{name}/joined/{r}"])]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        store.set(verdict_key, ", ".join(map(str, missing)))
        if missing:  # this process serves the store: the members present must read the verdict before it goes
            present = [r for r in range(1, size) if r not in missing]
            deadline = time.monotonic() + _GRACE_S
            while any(not store.check([f"{name}/heard/{r}"]) for r in present) and time.monotonic() < deadline:
                time.sleep(0.05)
        return ", ".join(map(str, missing))
    deadline = time.monotonic() + timeout_s + _GRACE_S
    while not store.check([verdict_key]):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    verdict = store.get(verdict_key).decode()
    store.set(f"{name}/heard/{rank}", "1")
    return verdict
