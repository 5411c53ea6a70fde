"""async_rl.mode separate: generation that goes on while the learner trains.

A thread runs the pool's rounds (megarl.rollout.inflight) back to back on an engine that never sleeps: it admits
prompts as the capacity rule allows, drops or restarts what went stale, and generates a chunk of every unfinished
sample per round (without chunks: until a pause, or the batch the learner waits for, makes the engine abort it). The
learner takes a batch when enough groups are done and trains while the next rounds run. A weight push pauses the
thread between rounds (pause, copy, continue): no round ever reads weights being written, and every token is tagged
with the version that sampled it. Anything that must see the pool and the loader together (a batch, a checkpoint)
pauses it the same way. A batch already done when a push ends is taken in the push's pause: without chunks, every
pause cuts the engine's round, whose unfinished samples are then prefilled again, so a take of its own would cost
that twice a step (once for the take, once for the round that follows the push).
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
        self._next: tuple[int, list[Group], dict[str, float]] | None = None
        """The batch a push's pause took for the version it made: (version, groups, metrics)."""
        self.cpu_s = 0.0
        """CPU seconds of this process that generation took (the engine's client side, the pool), all told."""
        self._cpu_seen = 0.0
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
                    start = time.thread_time()
                    self.pool.expire(self.version)
                    self.admit(self.version)
                    busy = any(not s.done for g in self.pool.groups for s in g.samples)
                    if busy:
                        self.pool.round(self.generate, self.params, self.version, stop=self._stop_round)
                    self.cpu_s += time.thread_time() - start
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

    @contextmanager
    def pushing(self, wanted: int) -> Iterator[None]:
        """Around a weight push: generation paused; after it the engine holds the next version, and if ``wanted``
        groups are done, the next step's batch is taken before generation goes on."""
        with self.paused("the weight push"):
            yield
            self.version += 1
            self.pool.expire(self.version)
            self.admit(self.version)
            if self.pool.ready() >= wanted:
                self._next = (self.version, *self._taken(wanted, self.version))

    def take(self, wanted: int, version: int) -> tuple[list[Group], dict[str, float]]:
        """The first ``wanted`` done groups once there are so many (generation goes on meanwhile), checked
        against the staleness bound at ``version``, the weights that train them; and the pool's async/* metrics."""
        if self._next is not None:
            taken_at, groups, metrics = self._next
            self._next = None
            assert taken_at == version, f"a batch taken for version {taken_at} asked for at version {version}"
            return groups, metrics
        self._waiting = wanted
        try:
            while True:
                self._raise()
                if self.pool.ready() >= wanted:  # a glance between rounds; a pause would stop an unchunked one
                    with self.paused("taking a batch"):
                        self.pool.expire(version)
                        if self.pool.ready() >= wanted:
                            return self._taken(wanted, version)
                time.sleep(0.01)
        finally:
            self._waiting = 0

    def _taken(self, wanted: int, version: int) -> tuple[list[Group], dict[str, float]]:
        """Take a batch, generation paused; with it the pool's metrics and the CPU generation took since the last."""
        groups = self.pool.take(wanted)
        cpu, self._cpu_seen = self.cpu_s - self._cpu_seen, self.cpu_s
        return groups, self.pool.metrics(groups, version) | {"async/generation_cpu_s": cpu}

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
