"""A value that rank 0 works out for every rank: it reads the files (or picks the port) once, and every rank acts
on the same answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import torch.distributed as dist

T = TypeVar("T")


def from_rank0(compute: Callable[[], T], rank: int) -> T:
    """``compute()``, run on rank 0 alone and sent to every rank of the default group (with no group, or one of a
    single rank, rank 0's own). Every rank of the group calls it."""
    value = [compute() if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(value, src=0)
    return cast(T, value[0])
