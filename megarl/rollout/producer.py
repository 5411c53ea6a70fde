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

Over several training processes every rank holds the same pool, and its thread takes part in each round's gather of
the engines' samples, so the threads must run the same rounds and serve the learner's requests (a batch, a pause) at
the same round boundaries, whenever each rank's learner asks. The learner posts its requests in program order, the
same on every rank; before each round the threads agree (``agree``: an all-reduce of the largest value over the
ranks): request k is served once every rank has posted it, and no round runs while a posted pause, or a request for
a batch that is done, waits for the ranks that have not asked yet. A batch is served once every rank asked for it
and the pool has it, so every rank takes the same groups.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from megarl.errors import UserError, at_failure
from megarl.rollout.base import SamplingParams
from megarl.rollout.inflight import Generate, Group, InFlight
from megarl.run.interrupt import at_interrupt

ABANDON_S = 10.0
"""How long a failed or interrupted learner waits for the generation thread to end its call."""

Agree = Callable[[list[int]], list[int]]
"""Each value's largest over the ranks (every rank's thread calls it with as many values, in the same order)."""


@dataclass(kw_only=True, slots=True)
class _Request:
    """What the learner asks of the generation thread."""

    kind: Literal["take", "pause", "stop"]
    what: str = ""
    wanted: int = 0
    version: int = 0
    granted: threading.Event = field(default_factory=threading.Event)
    """take: the batch is in ``taken``; pause: the thread holds between rounds until ``released``."""
    released: threading.Event = field(default_factory=threading.Event)
    taken: tuple[list[Group], dict[str, float]] | None = None


class Producer:
    def __init__(self, pool: InFlight, generate: Generate, params: SamplingParams, admit: Callable[[int], None],
                 timeout_s: float, agree: Agree | None = None) -> None:
        """``admit(version)``: fill the pool's room with new prompts; ``timeout_s``: the longest a pause may wait
        for the round in progress; ``agree``: over several training processes, their threads' agreement."""
        self.pool, self.generate, self.params, self.admit, self.timeout_s = pool, generate, params, admit, timeout_s
        self.agree = agree
        self.version = 0
        """The weights the engine holds: updates pushed so far."""
        self._requests: deque[_Request] = deque()
        """Posted by the learner and not served yet, served in order by the thread."""
        self._posted = self._served = 0
        self._next: tuple[int, list[Group], dict[str, float]] | None = None
        """The batch a push's pause took for the version it made: (version, groups, metrics)."""
        self.cpu_s = 0.0
        """CPU seconds of this process that generation took (the engine's client side, the pool), all told."""
        self._cpu_seen = 0.0
        self.error: BaseException | None = None
        self._met = False
        """Whether the learner was given ``error`` (where it waits, or when it posts)."""
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name="megarl-rollout", daemon=True)

    def start(self, version: int) -> None:
        self.version = version
        self._thread.start()
        at_failure(self.abandon)
        at_interrupt(self.abandon)

    def _run(self) -> None:
        try:
            while not self._abandoned:
                posted = self._posted
                head = self._requests[0] if posted > self._served else None
                # A ready batch holds the rounds as a pause does: the ranks that have not asked yet will take it.
                hold = head is not None and (head.kind != "take" or self.pool.can_take(head.wanted, head.version))
                everyone, someone_holds = self._agreed(posted, hold)
                if everyone:
                    assert head is not None
                    if head.kind == "stop":
                        return
                    if head.kind == "pause":
                        self._hold(head)
                        continue
                    if self._serve_take(head):
                        continue
                elif someone_holds:  # a rank waits to pause, or for a batch that is done: until every rank asked
                    time.sleep(0.001)
                    continue
                start = time.thread_time()
                self.pool.expire(self.version)
                self.admit(self.version)
                busy = any(not s.done for g in self.pool.groups for s in g.samples)
                if busy:  # a batch waits for its groups that would go stale next: cut only once they are done
                    must = self.pool.urgent(head.version, head.wanted) if head and head.kind == "take" else frozenset()
                    self.pool.round(self.generate, self.params, self.version, stop=self._stop_round, must=must)
                self.cpu_s += time.thread_time() - start
                if not busy:  # the pool is full and done: wait for the learner to take a batch
                    time.sleep(0.01)
        except BaseException as err:  # noqa: BLE001 (the learner re-raises it where it waits)
            self.error = err

    def _agreed(self, posted: int, hold: bool) -> tuple[bool, bool]:
        """Whether every rank has posted the next request, and whether a rank holds the rounds for its request."""
        if self.agree is None:
            return posted > self._served, hold
        fewest, holding = self.agree([-posted, int(hold)])
        return -fewest > self._served, bool(holding)

    def _hold(self, request: _Request) -> None:
        """Serve a pause: no round until the learner is done."""
        request.granted.set()
        request.released.wait()
        self._served_one()

    def _serve_take(self, request: _Request) -> bool:
        """Serve a batch if the pool has it; False: a round must make it first."""
        self.pool.expire(request.version)
        if not self.pool.can_take(request.wanted, request.version):
            return False
        request.taken = self._taken(request.wanted, request.version)
        self._served_one()
        request.granted.set()
        return True

    def _served_one(self) -> None:
        self._requests.popleft()
        self._served += 1

    def _stop_round(self, ready: int) -> bool:
        """An unchunked round (the engine aborts) ends for a pause, or once the learner's batch is done."""
        if self._posted == self._served:
            return False
        head = self._requests[0]
        return head.kind != "take" or head.wanted <= ready

    def _post(self, request: _Request) -> _Request:
        self._raise()
        self._requests.append(request)
        self._posted += 1  # after the append: the thread reads the count first
        return request

    def _wait(self, event: threading.Event, deadline: float | None, what: str) -> None:
        while not event.wait(0.01):
            self._raise()
            if deadline is not None and time.monotonic() > deadline:
                raise self._hung(what)

    def _hung(self, what: str) -> UserError:
        return UserError(f"{what}: the engine's round in progress did not end in {self.timeout_s:g} s "
                         "(rollout.timeout_minutes); the engine is hung. Fix: see its log (engine_*.log in the run "
                         "directory), or raise rollout.timeout_minutes.")

    @contextmanager
    def paused(self, what: str) -> Iterator[None]:
        """Hold the generation between rounds for ``what`` (a weight push, a batch, a checkpoint)."""
        request = self._post(_Request(kind="pause", what=what))
        try:
            self._wait(request.granted, time.monotonic() + self.timeout_s, what)
            yield
        finally:
            request.released.set()

    @contextmanager
    def pushing(self, wanted: int) -> Iterator[None]:
        """Around a weight push: generation paused; after it the engine holds the next version, and if ``wanted``
        groups are done, the next step's batch is taken before generation goes on."""
        with self.paused("the weight push"):
            try:
                yield
            except BaseException:
                # The engine may hold part of the new weights and part of the old: no round may sample from it (the
                # push's error ends the run; the checkpoint before it holds the pool as it was).
                self._abandoned = True
                raise
            self.version += 1
            self.pool.expire(self.version)
            self.admit(self.version)
            if self.pool.can_take(wanted, self.version):
                self._next = (self.version, *self._taken(wanted, self.version))

    def take(self, wanted: int, version: int) -> tuple[list[Group], dict[str, float]]:
        """The first ``wanted`` done groups once there are so many, among them every group that would be stale at
        the next version (generation goes on meanwhile), checked against the staleness bound at ``version``, the
        weights that train them; and the pool's async/* metrics."""
        self._raise()  # a thread that failed after the push's pause took this batch: not one more step
        if self._next is not None:  # every rank took it in the same pause
            taken_at, groups, metrics = self._next
            self._next = None
            assert taken_at == version, f"a batch taken for version {taken_at} asked for at version {version}"
            return groups, metrics
        request = self._post(_Request(kind="take", wanted=wanted, version=version))
        self._wait(request.granted, None, "taking a batch")
        assert request.taken is not None
        return request.taken

    def _taken(self, wanted: int, version: int) -> tuple[list[Group], dict[str, float]]:
        """Take a batch, generation paused; with it the pool's metrics and the CPU generation took since the last."""
        groups = self.pool.take(wanted)
        cpu, self._cpu_seen = self.cpu_s - self._cpu_seen, self.cpu_s
        return groups, self.pool.metrics(groups, version) | {"async/generation_cpu_s": cpu}

    def abandon(self) -> None:
        """The learner failed or was interrupted: the thread ends after the call or collective it is in (the other
        ranks' threads take part in theirs), so that this process never exits with it inside a collective."""
        self._abandoned = True
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=ABANDON_S)

    def close(self) -> None:
        """Stop the thread, once every rank's thread has ended the round it runs (each rank calls it); raise what
        ended it if that was an error the learner never met (after the last batch), unless the learner failed."""
        if self._thread.is_alive() and self.error is None:
            self._post(_Request(kind="stop"))
            self._thread.join(timeout=self.timeout_s)
            if self._thread.is_alive() and self.error is None and not self._abandoned:
                raise self._hung("the end of the run")
        if not self._abandoned and not self._met:
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            self._met = True
            raise self.error
