"""Wall time of the parts of a step (``rollout/engine``, ``handover/copy``, ...), for its metrics."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PartTimes:
    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the wall time of ``part`` (device work included) to its seconds."""
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[part] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The seconds since the last take, as ``part``_s metrics."""
        seconds, self.seconds = self.seconds, defaultdict(float)
        return {f"{k}_s": v for k, v in seconds.items()}
