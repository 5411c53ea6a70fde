"""Pick the device and collective backend for this process: a CUDA GPU with NCCL, or CPU with gloo."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class Platform:
    device: torch.device
    """The device this rank computes on (cuda:LOCAL_RANK, or cpu)."""
    backend: str
    """torch.distributed backend: nccl on GPU, gloo on CPU."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def init_platform() -> Platform:
    """Choose the device from LOCAL_RANK; on CPU install the megatron shim (before megatron imports)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return Platform(torch.device("cuda", local_rank), "nccl")
    from megarl.platform import cpu_shim

    cpu_shim.install()
    # Several ranks share the cores: without a cap each spawns one thread per core and they thrash.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return Platform(torch.device("cpu"), "gloo")


def host_memory() -> tuple[int, int] | None:
    """This node's (total, in use) bytes from /proc/meminfo (in use = MemTotal - MemAvailable); None without it."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        total, available = (int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):
        return None
    return total, total - available
