"""Scoring samples with trainer.reward: in the trainer's process, or in worker processes (trainer.reward_workers),
either a batch at once (split among the workers) or a group at a time while the caller goes on (async_rl scores a
group as soon as its samples are done, while the engine generates the rest)."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import threading
import time
import weakref
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from megarl.errors import UserError
from megarl.rewards.registry import RewardFn, load_reward
from megarl.rewards.text import reads_tool_turns


def no_reward(completions: list[str], answers: list[str]) -> list[float]:
    """trainer.reward null (on-policy distillation alone): no task signal."""
    return [0.0] * len(completions)


_worker_fn: RewardFn | None = None
"""A worker process's reward function, loaded once when it starts."""


def _load(spec: str, parent: int) -> None:
    global _worker_fn
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer handles it
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    _worker_fn = load_reward(spec)


def _exit_with(parent: int) -> None:
    """A worker whose training process was killed (no shutdown reached it) exits instead of living on."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _ready() -> None:
    """A task that starts a worker."""


def _score(completions: list[str], answers: list[str]) -> list[float]:
    assert _worker_fn is not None, "the worker's initializer loads the reward"
    return _worker_fn(completions, answers)


class RewardWorkerDied(UserError):
    """A reward worker died twice while scoring the same samples: one paragraph, exit code 2."""

    on_every_rank = False  # only the rank whose worker died sees it


@dataclass(eq=False)
class _Part:
    """Samples submitted to a pool, kept until their scores are read: a worker's death loses them all."""

    completions: list[str]
    answers: list[str]
    pool: ProcessPoolExecutor
    retry: bool
    """Submitted again after a worker's death: a second death of the same samples ends the run."""
    again: Future[list[float]] | None = None
    """Their submission to the fresh pool, once the pool that held them broke."""


class RewardScorer:
    def __init__(self, spec: str | None, workers: int) -> None:
        """``spec``: trainer.reward ("module:function", None for no reward); ``workers``: processes that run it
        (0: this one). Workers are spawned, not forked: the trainer's process holds CUDA and threads."""
        self.fn: RewardFn = load_reward(spec) if spec is not None else no_reward  # a bad spec fails here, at once
        self.reads_tool_turns = reads_tool_turns(self.fn)  # which text of a multi-turn sample it scores
        self.spec = spec
        self.workers = workers if spec is not None else 0
        self._pool: ProcessPoolExecutor | None = None
        # separate: the generation thread submits groups while the learner's thread reads scores
        self._lock = threading.Lock()
        self._parts: weakref.WeakKeyDictionary[Future[list[float]], _Part] = weakref.WeakKeyDictionary()
        """The pool's futures not read yet (a stale group's, dropped unread, drops out by itself)."""
        if self.workers:
            self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        assert self.spec is not None, "workers run only a reward that is set"
        pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_load, initargs=(self.spec, os.getpid()))
        for _ in range(self.workers):  # start them now, while the engine starts, not in the first step
            pool.submit(_ready)
        # Shut down before the interpreter does: a pool it collects while tearing down its modules prints an
        # "Exception ignored ... weakref_cb" traceback under the run's last message (an error's paragraph).
        atexit.register(pool.shutdown)
        return pool

    def __call__(self, completions: list[str], answers: list[str]) -> list[float]:
        """One score per completion, now: split into one part per worker."""
        if self._pool is None:
            return self.fn(completions, answers)
        size = -(-len(completions) // self.workers)
        parts = [self.submit(completions[i:i + size], answers[i:i + size]) for i in range(0, len(completions), size)]
        return [score for part in parts for score in self.result(part)]

    def submit(self, completions: list[str], answers: list[str]) -> Future[list[float]]:
        """Scores that a worker computes while the caller goes on (without workers: computed now)."""
        if self._pool is not None:
            with self._lock:
                return self._submit(completions, answers, retry=False)
        done: Future[list[float]] = Future()
        try:
            done.set_result(self.fn(completions, answers))
        except BaseException as err:  # noqa: BLE001 (raised where the result is read, as a worker's would be)
            done.set_exception(err)
        return done

    def _submit(self, completions: list[str], answers: list[str], retry: bool) -> Future[list[float]]:
        assert self._pool is not None
        try:
            scores = self._pool.submit(_score, completions, answers)
        except BrokenProcessPool:  # a worker died since the last call, which nothing has read yet
            self._restart(self._pool)
            scores = self._pool.submit(_score, completions, answers)
        self._parts[scores] = _Part(completions, answers, self._pool, retry)
        return scores

    def result(self, scores: Future[list[float]]) -> list[float]:
        """A submitted part's scores; a reward's own error is raised as it is (it names trainer.reward). A worker's
        death (a user's reward can die of its own memory use) costs a fresh pool and the lost samples scored
        again; a second death of the same samples ends the run."""
        while True:
            try:
                return scores.result()
            except BrokenProcessPool:
                with self._lock:
                    part = self._parts[scores]
                    if part.again is None:
                        self._restart(part.pool)
                    assert part.again is not None, "a restart submits again every part its broken pool held"
                    scores = part.again

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        """A fresh pool in place of ``broken``, with every part ``broken`` lost submitted to it (under the lock)."""
        held = [(scores, part) for scores, part in list(self._parts.items()) if part.pool is broken]
        wait([scores for scores, _ in held])  # a broken pool fails all its futures at once
        lost = [part for scores, part in held if isinstance(scores.exception(), BrokenProcessPool)]
        cause = _end(broken)
        if any(part.retry for part in lost):
            raise RewardWorkerDied(
                f"a reward worker process died ({cause}) while scoring samples again that a worker's death had lost "
                f"before (trainer.reward_workers = {self.workers}, trainer.reward = {self.spec!r}): killed, most "
                "often for memory (the kernel's OOM killer sends SIGKILL), or crashed inside the reward function's "
                "native code. Training stopped; the last complete checkpoint is intact and resumes with "
                "checkpoint.resume: auto. Fix: see the messages above; lower the reward's memory use or "
                "trainer.reward_workers, or score in the trainer's process (trainer.reward_workers: 0) to see the "
                "error where it happens.")
        self._pool = self._start()
        samples = sum(len(part.completions) for part in lost)
        again = f"scoring its {samples} lost samples again" if samples else "it held no samples; scoring goes on"
        print(f"megarl: a reward worker process died ({cause}); {again} in a fresh pool of {self.workers} (a second "
              "death of the same samples ends the run)", flush=True)
        for part in lost:
            part.again = self._submit(part.completions, part.answers, retry=True)

    def close(self) -> None:
        if self._pool is not None:
            atexit.unregister(self._pool.shutdown)
            self._pool.shutdown(wait=False, cancel_futures=True)


def _end(broken: ProcessPoolExecutor) -> str:
    """Shut a broken pool down; how its worker died: the first exit but those of the workers the pool itself
    terminated (SIGTERM) after. Its processes are read once it has joined them: until then one may not be reaped."""
    workers = list(broken._processes.values())
    atexit.unregister(broken.shutdown)
    broken.shutdown(wait=True)
    ends = [p.exitcode for p in workers if p.exitcode not in (None, -signal.SIGTERM)]
    if not ends:
        return "its exit is unknown"
    code = ends[0]
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
