"""async_rl's rollout side, between the pool of samples in flight (megarl.rollout.inflight) and the loop: which
groups a step trains, generated in the step (colocated_async) or by a thread that runs while the learner trains
(separate, megarl.rollout.producer). docs/async.md has the modes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from megarl.config import Config
from megarl.data.batching import TokenizedPrompt
from megarl.loop.timing import PartTimes
from megarl.rollout.base import SamplingParams
from megarl.rollout.inflight import Generate, Group, InFlight
from megarl.rollout.producer import Agree, Producer


def carries_samples(cfg: Config) -> bool:
    """Whether samples may outlive their step. max_staleness 0 may not: the sync loop's rollout runs unchanged,
    so its batches are the sync loop's, bit for bit."""
    return cfg.async_rl.mode != "sync" and cfg.async_rl.max_staleness > 0


def prefill_note(cfg: Config) -> str | None:
    """What to say at start-up when chunked rounds meet SGLang's radix cache turned off: every round then prefills
    each sample's prompt and tokens so far again (measured on an H200: 3x the engine's time per token on GSM8K,
    benchmarks/results/h200/async_opd). The cache is flushed at every hand-over, so it never serves older KV."""
    if not carries_samples(cfg) or cfg.async_rl.chunk_tokens is None or cfg.rollout.engine != "sglang" \
            or not cfg.rollout.engine_args.get("disable_radix_cache"):
        return None
    return ("megarl: note: async_rl.chunk_tokens with rollout.engine_args.disable_radix_cache = true: every round "
            "prefills each unfinished sample's prompt and tokens so far again. Remove disable_radix_cache (the "
            "cache is flushed at every weight hand-over).")


def mps_note(cfg: Config, on_cuda: bool, environ: Mapping[str, str] = os.environ) -> str | None:
    """What to say at start-up when `separate` shares a GPU with no MPS daemon serving it: the engine's and the
    learner's kernels then take turns on the GPU, and the learner's passes run up to 2x slower beside the
    generating engine (measured on an H200: 1.31x the sync loop's tokens/s on the GSM8K recipe, 1.55x under MPS,
    benchmarks/results/h200/async_opd/session6). The daemon's control pipe is where CUDA's clients look for it."""
    if cfg.async_rl.mode != "separate" or not on_cuda:
        return None
    pipe_dir = Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    try:
        if (pipe_dir / "control").exists():
            return None
    except OSError:  # another user's daemon, whose directory this one may not search: a note is not worth a crash
        return None
    return (f"megarl: note: async_rl.mode = separate with no MPS daemon (no control pipe in {pipe_dir}): the "
            "engine's and the learner's kernels take turns on each GPU. Start one before the run "
            "(nvidia-cuda-mps-control -d) to let them run at once: 1.55x the sync loop's tokens/s against 1.31x "
            "on one H200 (docs/async.md).")


class PartialRollouts:
    def __init__(self, cfg: Config, stop_ids: tuple[int, ...], times: PartTimes,
                 finished: Callable[[list[Group]], None], agree: Agree | None = None) -> None:
        """``finished``: told of the groups a round finished (megarl.rollout.inflight.InFlight); ``agree``:
        separate over several processes, their generation threads' agreement (megarl.rollout.producer)."""
        a, r, wanted = cfg.async_rl, cfg.rollout, cfg.data.num_prompts_per_step
        self.separate, self.wanted, self.times, self.timeout_s = a.mode == "separate", wanted, times, \
            r.timeout_minutes * 60
        self.pool = InFlight(n=r.num_samples_per_prompt, budget=r.max_new_tokens, chunk=a.chunk_tokens,
                             max_staleness=a.max_staleness, batch=wanted,
                             capacity=a.prompts_in_flight(wanted), stale=a.stale, seed=r.seed, finished=finished)
        self.params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                     max_new_tokens=r.max_new_tokens, seed=r.seed, stop_token_ids=stop_ids)
        self.producer: Producer | None = None
        self.agree = agree

    def take(self, generate: Generate, next_prompts: Callable[[], list[TokenizedPrompt]], step: int
             ) -> tuple[list[Group], dict[str, float]]:
        """The groups step ``step`` trains (the engines hold the weights of version ``step``), and async/*."""
        def admit(version: int) -> None:
            while self.pool.room(version) >= self.wanted:
                self.pool.admit([(p.tokens, p.record.answer) for p in next_prompts()], version)

        if self.separate:
            if self.producer is None:  # the first step (or the first after a resume) starts the generation
                self.producer = Producer(self.pool, generate, self.params, admit, self.timeout_s, self.agree)
                self.producer.start(step)
            with self.times.timed("rollout/wait"):
                return self.producer.take(self.wanted, step)
        self.pool.expire(step)
        admit(step)
        with self.times.timed("rollout/engine"):
            rounds = self.pool.fill(generate, self.params, self.wanted, step)
        taken = self.pool.take(self.wanted)
        return taken, self.pool.metrics(taken, step) | {"async/rounds": float(rounds)}

    @contextmanager
    def pushing(self) -> Iterator[None]:
        """Around a weight push: separate's generation pauses between chunks, and goes on with the new version (a
        batch already done for it taken first)."""
        if self.producer is None:
            yield
            return
        with self.producer.pushing(self.wanted):
            yield

    def consistent(self) -> Any:
        """Where the pool and the data loader must be read together (a checkpoint): generation paused."""
        return self.producer.paused("the checkpoint") if self.producer is not None else nullcontext()

    def state_dict(self) -> dict[str, Any]:
        return self.pool.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cut, restarted = self.pool.load_state_dict(state, frozenset(self.params.stop_token_ids))
        if restarted:
            print(f"megarl: {restarted} prompt(s) in flight in the checkpoint have groups of another "
                  f"rollout.num_samples_per_prompt: each starts again from its prompt with "
                  f"{self.pool.n} samples", flush=True)
        if cut:
            print(f"megarl: {cut} sample(s) in flight in the checkpoint ran past an EOS (written before megarl "
                  "completed a sample at its EOS whatever the engine's finish reason): each is cut after it and "
                  "done", flush=True)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
