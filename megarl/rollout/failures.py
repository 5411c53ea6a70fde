"""Engine failures as megarl errors: an engine call that raises stops training with one message naming the
phase, the engine's error and the memory in use; one that hangs ends the process after a deadline.

A colocated engine fails in ways the trainer cannot recover from (out of memory at wake, a dead worker
process), and under torchrun a raw exception on the driving rank reads as a crash of every rank. The
other ranks wait in a collective for the driver; once it exits, torchrun stops them.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.errors import UserError
from megarl.platform.device import host_memory


class EngineFailed(UserError):
    """The rollout engine failed (reported as one paragraph; the last complete checkpoint is intact)."""

    on_every_rank = False  # only the engine's driver sees it


def memory_summary() -> str:
    """What this machine's memory holds now: per visible GPU, or the host's."""
    if torch.cuda.is_available():
        parts = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            parts.append(f"GPU {i}: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use, this process "
                         f"{torch.cuda.memory_reserved(i) / 2**30:.1f} GiB reserved")
        return "; ".join(parts)
    host = host_memory()
    if host is None:
        return "host memory unknown"
    total, used = host
    return f"host: {used / 2**30:.1f} of {total / 2**30:.1f} GiB in use"


def _hung(phase: str, timeout_s: float) -> None:
    print(f"megarl error: the rollout engine did not finish {phase} within {timeout_s:.0f} s "
          f"(rollout.timeout_minutes). Memory: {memory_summary()}. Training stopped; the last complete checkpoint "
          "is intact. Look at the engine's log (engine_*.log in the run directory) for the cause, or raise "
          "rollout.timeout_minutes if "
          "generation is legitimately that slow.", file=sys.stderr, flush=True)
    os._exit(3)


@contextmanager
def engine_call(phase: str, timeout_s: float) -> Iterator[None]:
    """Guard one engine call: an exception becomes EngineFailed; no return within timeout_s ends the process."""
    timer = threading.Timer(timeout_s, _hung, args=(phase, timeout_s))
    timer.daemon = True
    timer.start()
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        text = " ".join(str(err).split())[-1500:] or "(no message)"
        raise EngineFailed(f"the rollout engine failed during {phase}: {type(err).__name__}: {text} Memory: "
                           f"{memory_summary()}. The engine's log is engine_*.log in the run directory. "
                           "Training stopped; the last complete checkpoint is intact and "
                           "resumes with checkpoint.resume: auto. If the engine ran out of memory, lower "
                           "rollout.gpu_memory_fraction or enable offloading (actor.offload_optimizer, "
                           "actor.offload_weights, critic.offload_weights, reference.offload_weights).") from err
    finally:
        timer.cancel()
