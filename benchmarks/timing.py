"""The one timing helper of the benchmark suite: device-synchronised wall time, slowest-rank reduction."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, barrier: bool = True) -> float:
    """Milliseconds from a common start (barrier) until ``fn``'s device work finished on this rank."""
    sync(device)
    if barrier and dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def slowest(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over ranks: a refit is done when its slowest receiver is done."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
