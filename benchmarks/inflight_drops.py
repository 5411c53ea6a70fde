"""Groups colocated_async drops as stale, with a scripted engine whose samples stop at random lengths (the setting of
tests/test_inflight.py's property test, stale: drop), over SEEDS seeds x STEPS steps:

  python benchmarks/inflight_drops.py [--seeds 40] [--steps 20]

Each seed draws max_staleness (1-3), the batch (2 or 4 groups), samples per group (2 or 4), chunk_tokens (3, 8 or
the engine's abort) and the stop probability per token (0.02 or 0.1) like the test does."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from typing import Literal

from megarl.rollout.base import Completion, Enough, SamplingParams, request_budget
from megarl.rollout.inflight import InFlight


class RandomLengths:
    """A sample stops at each token with probability ``stop`` (drawn from its seed and prompt); with ``enough``,
    every request makes a token per engine step and the rest are aborted once it says so."""

    def __init__(self, stop: float) -> None:
        self.stop = stop

    def __call__(self, prompts: list[list[int]], params: SamplingParams, enough: Enough | None = None
                 ) -> list[Completion]:
        out = []
        for i, prompt in enumerate(prompts):
            rng = random.Random(hash((params.seeds[i] if params.seeds else 0, tuple(prompt))))
            tokens: list[int] = []
            finish: Literal["stop", "length"] = "length"
            while len(tokens) < request_budget(params, i):
                tokens.append(1)
                if rng.random() < self.stop:
                    finish = "stop"
                    break
            out.append(Completion(prompt_index=i, token_ids=tokens, logprobs=[-1.0] * len(tokens),
                                  finish_reason=finish))
        if enough is None:
            return out
        finished: list[int] = []
        for t in range(1, max(len(c.token_ids) for c in out) + 1):
            finished += [c.prompt_index for c in out if len(c.token_ids) == t]
            if len(finished) < len(out) and enough(finished):
                return [c if len(c.token_ids) <= t else Completion(
                    prompt_index=c.prompt_index, token_ids=c.token_ids[:t], logprobs=c.logprobs[:t],
                    finish_reason="abort") for c in out]
        return out


def drops(seed: int, steps: int) -> tuple[float, int]:
    rng = random.Random(seed)
    staleness, wanted, n = rng.choice([1, 2, 3]), rng.choice([2, 4]), rng.choice([2, 4])
    rng.choice(["drop", "regenerate"])  # the test's draw, kept so that the seeds draw the test's settings
    prompts: Sequence[list[int]] = [[7] * rng.randint(1, 9) for _ in range(400)]
    chunk = rng.choice([3, 8, None])
    pool = InFlight(n=n, budget=40, chunk=chunk, max_staleness=staleness, batch=wanted,
                    capacity=(staleness + 1) * wanted, stale="drop", seed=11)
    engine, params, cursor = RandomLengths(rng.choice([0.02, 0.1])), SamplingParams(temperature=1.0, seed=5), 0
    for step in range(steps):
        pool.expire(step)
        while pool.room(step) >= wanted:
            pool.admit([(prompts[i], str(i)) for i in range(cursor, cursor + wanted)], step)
            cursor += wanted
        pool.fill(engine, params, wanted, step)
        pool.take(wanted)
    return pool.metrics([], steps)["async/dropped_stale"], steps * wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    results = [drops(seed, args.steps) for seed in range(args.seeds)]
    dropped, trained = sum(d for d, _ in results), sum(t for _, t in results)
    print(json.dumps({"seeds": args.seeds, "steps": args.steps, "groups_trained": trained,
                      "groups_dropped": int(dropped), "seeds_with_drops": sum(d > 0 for d, _ in results)}))


if __name__ == "__main__":
    main()
