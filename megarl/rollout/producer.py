"""async_rl.mode separate: generation that goes on while the learner trains.

A thread runs the pool's rounds (megarl.rollout.inflight) back to back on an engine that never sleeps: it admits
prompts as the capacity rule allows, drops or restarts what went stale, and generates a chunk of every unfinished
sample per round (without chunks: until a pause, or the batch the learner waits for, makes the engine abort it). The
learner takes a batch when enough groups are done and trains while the next rounds run. A weight push pauses the
thread between rounds (pause, copy, continue): no round ever reads weights being written, and every token is tagged
with the version that sampled it. Anything that must see the pool and the loader together (a batch, a checkpoint)
pauses it the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from megarl.errors import UserError
from megarl.rollout.base import SamplingParams
from megarl.rollout.inflight import Generate, Group, InFlight


class Producer:
    def __init__(self, pool: InFlight, generate: Generate, params: SamplingParams, admit: Callable[[int], None],
                 timeout_s: float) -> None:
        """``admit(version)``: fill the pool's room with new prompts; ``timeout_s``: the longest a pause may wait
        for the round in progress."""
        self.pool, self.generate, self.params, self.admit, self.timeout_s = pool, generate, params, admit, timeout_s
        self.version = 0
        """The weights the engine holds: updates pushed so far."""
        self._lock = threading.Lock()  # held for a round, and by a pause
        self._pause = threading.Event()
        self._waiting = 0
        """Groups the learner waits for (0: none): without chunks, a round stops once they are done."""
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megarl-rollout", daemon=True)

    def start(self, version: int) -> None:
        self.version = version
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop:
                if self._pause.is_set():
                    time.sleep(0.001)
                    continue
                with self._lock:
                    if self._stop or self._pause.is_set():
                        continue
                    self.pool.expire(self.version)
                    self.admit(self.version)
                    busy = any(not s.done for g in self.pool.groups for s in g.samples)
                    if busy:
                        self.pool.round(self.generate, self.params, self.version, stop=self._stop_round)
                if not busy:  # the pool is full and done: wait for the learner to take a batch
                    time.sleep(0.01)
        except BaseException as err:  # noqa: BLE001 (the learner re-raises it where it waits)
            self.error = err

    def _stop_round(self, ready: int) -> bool:
        """An unchunked round (the engine aborts) ends for a pause, or once the learner's batch is done."""
        return self._pause.is_set() or 0 < self._waiting <= ready

    @contextmanager
    def paused(self, what: str) -> Iterator[None]:
        """Hold the generation between rounds for ``what`` (a weight push, a batch, a checkpoint)."""
        self._raise()
        self._pause.set()
        try:
            if not self._lock.acquire(timeout=self.timeout_s):
                raise UserError(f"{what}: the engine's round in progress did not end in {self.timeout_s:g} s "
                                "(rollout.timeout_minutes); the engine is hung. Fix: see its log (engine_*.log in "
                                "the run directory), or raise rollout.timeout_minutes.")
            try:
                yield
            finally:
                self._lock.release()
        finally:
            self._pause.clear()

    def take(self, wanted: int, version: int) -> list[Group]:
        """The first ``wanted`` done groups once there are so many (generation goes on meanwhile), checked
        against the staleness bound at ``version``, the weights that train them."""
        self._waiting = wanted
        try:
            while True:
                self._raise()
                if self.pool.ready() >= wanted:  # a glance between rounds; a pause would stop an unchunked one
                    with self.paused("taking a batch"):
                        self.pool.expire(version)
                        if self.pool.ready() >= wanted:
                            return self.pool.take(wanted)
                time.sleep(0.01)
        finally:
            self._waiting = 0

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
