"""Scoring samples with trainer.reward: in the trainer's process, or in worker processes (trainer.reward_workers),
either a batch at once (split among the workers) or a group at a time while the caller goes on (async_rl scores a
group as soon as its samples are done, while the engine generates the rest)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from megarl.rewards.registry import RewardFn, load_reward


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


class RewardScorer:
    def __init__(self, spec: str | None, workers: int) -> None:
        """``spec``: trainer.reward ("module:function", None for no reward); ``workers``: processes that run it
        (0: this one). Workers are spawned, not forked: the trainer's process holds CUDA and threads."""
        self.fn: RewardFn = load_reward(spec) if spec is not None else no_reward  # a bad spec fails here, at once
        self.workers = workers if spec is not None else 0
        self._pool: ProcessPoolExecutor | None = None
        if spec is not None and workers:
            self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_load, initargs=(spec, os.getpid()))
            for _ in range(workers):  # start them now, while the engine starts, not in the first step
                self._pool.submit(_ready)

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
            return self._pool.submit(_score, completions, answers)
        done: Future[list[float]] = Future()
        try:
            done.set_result(self.fn(completions, answers))
        except BaseException as err:  # noqa: BLE001 (raised where the result is read, as a worker's would be)
            done.set_exception(err)
        return done

    def result(self, scores: Future[list[float]]) -> list[float]:
        """A submitted part's scores; a reward's own error is raised as it is (it names trainer.reward)."""
        try:
            return scores.result()
        except BrokenProcessPool:
            raise RuntimeError(
                f"a reward worker process died (trainer.reward_workers = {self.workers}): killed, most often for "
                "memory, or crashed inside the reward function's native code. Fix: see the messages above; score "
                "in the trainer's process (trainer.reward_workers: 0) to see the error where it happens.") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
