"""The hand-over's process group when engines run on GPUs of their own, in processes outside the trainer's world.

The trainer's ranks keep their torchrun world (megatron's groups live there); the engine workers are not in it.
Both join one more group, numbered as the plan numbers its GPUs (``make_plan(..., engine_gpus=E)``): the trainer's
world ranks 0..W-1, then engine GPUs W..W+E-1. ``Resharder(..., group=handover_group(...))`` then moves each
engine GPU exactly its bytes over it (NCCL between GPUs, gloo on CPU).

torch registers only groups carved out of a process's own world (``new_group``), and P2P operations need a
registered group, so this builds the group with c10d's own helper and registers its ranks, as SGLang's
``init_weights_update_group`` does; ``tests/test_reshard.py`` runs a refit through it, which a change in torch's
private API would fail.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megarl.errors import UserError


class HandoverGroupTimeout(UserError):
    """Not every member joined the hand-over group in time: named, instead of a push that hangs."""

    on_every_rank = False  # each member saw its own part: rank 0 may be the one that is gone


def handover_group(rank: int, size: int, host: str, port: int, *, backend: str, timeout_s: float,
                   name: str = "megarl_handover") -> dist.ProcessGroup:
    """Join the group of ``size`` members as ``rank`` (the plan's GPU number), meeting over a TCP store at
    ``host:port`` that rank 0 serves. Every member waits at most ``timeout_s`` for the others, then raises
    HandoverGroupTimeout naming the members missing by the plan's numbers; the group's collectives wait as long."""
    timeout = timedelta(seconds=timeout_s)
    where = f"the weight hand-over group ({size} members, meeting at {host}:{port})"
    deadline = time.monotonic() + timeout_s
    missing = list(range(size))
    try:
        store = dist.TCPStore(host, port, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        store.set(f"{name}/joined/{rank}", "1")
        while missing := [r for r in range(size) if not store.check([f"{name}/joined/{r}"])]:
            if time.monotonic() > deadline:
                raise HandoverGroupTimeout(
                    f"{where}: member(s) {', '.join(map(str, missing))} did not join within {timeout_s:.0f} s. "
                    "Each engine worker joins once its engine has started: see the engine workers' logs for the "
                    "one that did not (its start may have failed, or its GPU may be taken), or raise "
                    "rollout.timeout_minutes if engines start slowly here.")
            time.sleep(0.05)
    except dist.DistError as err:  # rank 0, which serves the meeting point, never came or has given up
        raise HandoverGroupTimeout(
            f"{where}: the meeting point, served by member 0 (the trainer's rank 0), was lost or never reached "
            f"({type(err).__name__}), with member(s) {', '.join(map(str, missing))} not seen joining. See the "
            "trainer's log for why it stopped.") from err
    group, _ = c10d._new_process_group_helper(size, rank, [], backend, dist.PrefixStore(name, store),
                                              group_name=c10d.GroupName(name), timeout=timeout)
    c10d._world.pg_group_ranks[group] = {r: r for r in range(size)}
    return group
