"""async_rl: whether rollouts overlap the updates, and how stale a sample may be (docs/async.md). The section is
not called `async`, a Python keyword that no config field can be named."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config.checks import within
from megarl.config.yaml_io import check


@dataclass(kw_only=True, slots=True)
class AsyncConfig:
    mode: Literal["sync", "colocated_async", "separate"] = "sync"
    """sync: every step generates its batch with the weights it trains, and waits for its slowest sample.
    colocated_async: the engines keep more prompts in flight than a batch needs and generate in chunks of
    chunk_tokens; once enough whole groups are done, the batch trains, and the unfinished samples keep their
    tokens, logprobs and weight versions and continue under the next weights (partial rollouts). separate: the
    engine never sleeps and generates while the learner trains, pausing between chunks only for a weight push
    (each rank's engine shares its trainer's device, with a memory fraction of its own, unless engine_gpus)."""
    max_staleness: int = 1
    """Most weight versions a sample's oldest token may lag the weights its batch trains (0 = the sync loop's
    batches). A group past it is dropped or generated again (stale)."""
    in_flight_prompts: int | None = None
    """Prompts in flight at once, in whole steps' worth (a multiple of data.num_prompts_per_step); null = as many
    as the staleness bound lets finish in time, (max_staleness + 1) x data.num_prompts_per_step (AReaL's
    capacity rule)."""
    chunk_tokens: int | None = 128
    """Tokens a sample generates per engine call; between calls the loop checks whether a batch is done, and a
    weight push (separate) waits for the call. Smaller cuts the wait for the slowest samples finer and prefills
    each prefix more often. null: no chunks; the engine generates every sample to its budget and aborts the
    unfinished ones as soon as a batch is done or a push is due (one engine: vLLM or SGLang)."""
    engine_gpus: int = 0
    """separate: GPUs of the engines' own, after the trainer's on the node (torchrun starts one trainer rank per
    GPU of the rest); 0 = each engine shares its trainer's GPUs. They form engine_gpus / rollout.tensor_parallel
    engines, each driven by an equal share of the trainer's ranks, and every hand-over sends each engine GPU only
    the bytes it lacks (megarl.reshard.receiver)."""
    stale: Literal["drop", "regenerate"] = "drop"
    """A group past max_staleness: drop it (its prompt is not trained on; counted in async/dropped_stale), or
    regenerate it from its prompt with the current weights."""

    def prompts_in_flight(self, per_step: int) -> int:
        """Prompts the engines hold at once when a step takes ``per_step``: in_flight_prompts, or AReaL's capacity
        (max_staleness + 1 steps' worth); one step's when samples never outlive their step (sync, staleness 0)."""
        if self.mode == "sync" or self.max_staleness == 0:
            return per_step
        return self.in_flight_prompts or (self.max_staleness + 1) * per_step

    def __post_init__(self) -> None:
        within(self, "max_staleness", "[0, inf)", "use 1 (one-step-off) to 4 (with a rollout correction)")
        within(self, "chunk_tokens", "[1, inf)", "use 64-256")
        within(self, "engine_gpus", "[0, inf)", "use 0 (engines share the trainer's GPUs) or the GPUs to give them")
        check(self.in_flight_prompts is None or self.in_flight_prompts >= 1, "in_flight_prompts",
              self.in_flight_prompts, "be null or >= 1", "use null, or a multiple of data.num_prompts_per_step")
