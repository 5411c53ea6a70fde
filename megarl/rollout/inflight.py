"""Partial rollouts across weight versions (async_rl.mode: colocated_async): the prompt groups in flight, their
samples' tokens, logprobs and the weight version that sampled each token.

A round asks the engines for at most ``chunk`` more tokens of every unfinished sample: the request is the prompt
and the sample's tokens so far, with the budget it has left, so a sample cut at a chunk's end goes on where it
stopped, under whatever weights the engines hold by then. Without chunks (``chunk`` None), a round runs every
unfinished sample to its budget until the caller has enough groups done, and the engine aborts the rest
(megarl.rollout.base.Aborting), which resume the same way. Every hand-over flushes the engines' prefix caches
(megarl.rollout.sglang, megarl.rollout.vllm), so a resumed prefix is prefilled again by the new weights: no KV
computed by older weights is read. A step's batch is ``wanted`` groups whose samples are all done, oldest token
first (then in admission order); the others stay in flight. A step waits for the groups that would be past
``max_staleness`` at the next one (the oldest batch of them), and takes them: colocated_async drops a group only
when more than a batch of them go stale at once. Before a round, a group whose oldest token is more than
``max_staleness`` versions older than the engines' weights is dropped or restarted from its prompt
("regenerate"); so a batch trained by version v holds no token older than v - max_staleness.

Admission follows AReaL's capacity rule: a group is admitted under version v only if the groups taken so far and
in flight, with it, fit in the batches of steps up to v + max_staleness, so that it can be trained before it goes
stale (and at most ``capacity`` groups are in flight). The pool is plain data (``state_dict``): a checkpoint
holds it, and a resume goes on with exactly the samples an uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from megarl.rollout.base import Completion, Enough, SamplingParams
from megarl.rollout.stops import ends_in_stop


class Generate(Protocol):
    """An engine's (or all engines') generate: ``params.n`` completions per prompt, in prompt order; with
    ``enough``, the engine's ``generate_until`` (megarl.rollout.base.Aborting)."""

    def __call__(self, prompts: list[list[int]], params: SamplingParams, enough: Enough | None = None, /
                 ) -> list[Completion]: ...


@dataclass(kw_only=True, slots=True)
class Partial:
    """One sample in flight."""

    seed: int | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The weight version (updates the engine's weights had had) that sampled each token."""
    done: bool = False
    truncated: bool = False
    """Stopped by the budget, not by a stop token (one that ends the budget is a stop: the sample is complete)."""


@dataclass(kw_only=True, slots=True)
class Group:
    """A prompt's samples; ``uid`` orders groups by admission."""

    uid: int
    prompt: list[int]
    answer: str
    admitted: int
    """The version the group was admitted (or regenerated) under."""
    samples: list[Partial]

    def done(self) -> bool:
        return all(s.done for s in self.samples)

    def oldest(self) -> int | None:
        """The version of its oldest token; None before its first."""
        return min((s.versions[0] for s in self.samples if s.versions), default=None)


def _age(g: Group) -> tuple[int, int]:
    """Oldest token first, then admission order (a group with no token yet last)."""
    oldest = g.oldest()
    return (oldest if oldest is not None else 1 << 62, g.uid)


class InFlight:
    """The pool: ``admit`` prompts, ``fill`` a batch of whole groups over rounds of chunks, ``take`` it."""

    def __init__(self, *, n: int, budget: int, chunk: int | None, max_staleness: int, batch: int, capacity: int,
                 stale: Literal["drop", "regenerate"], seed: int | None,
                 finished: Callable[[list[Group]], None] = lambda groups: None) -> None:
        """``batch``: the groups a step takes; ``capacity``: the most in flight at once; ``finished``: told of the
        groups whose last sample a round finished, at the round's end (the reward scores them while the rest
        generate)."""
        self.n, self.budget, self.chunk, self.max_staleness = n, budget, chunk, max_staleness
        self.batch, self.capacity, self.stale, self.seed = batch, capacity, stale, seed
        self.finished = finished
        self.groups: list[Group] = []
        self.next_uid = 0
        self.taken = 0
        """Groups taken for training so far."""
        self.dropped = 0
        """Groups dropped as stale since the last ``metrics``."""
        self.regenerated = 0

    def room(self, version: int) -> int:
        """Groups that may be admitted under the weights of ``version``."""
        return max(0, min(self.capacity, (version + self.max_staleness + 1) * self.batch - self.taken)
                   - len(self.groups))

    def admit(self, prompts: Sequence[tuple[Sequence[int], str]], version: int) -> None:
        """New groups of (prompt tokens, reference answer), their samples seeded by their place in the run."""
        for prompt, answer in prompts:
            uid = self.next_uid
            self.next_uid += 1
            self.groups.append(Group(uid=uid, prompt=list(prompt), answer=answer, admitted=version,
                                     samples=self._fresh(uid, 0)))

    def _fresh(self, uid: int, attempt: int) -> list[Partial]:
        base = None if self.seed is None else self.seed + (uid * self.n + attempt * 7919) * 1009
        return [Partial(seed=None if base is None else base + j) for j in range(self.n)]

    def expire(self, version: int) -> None:
        """Drop, or restart from the prompt, the groups whose oldest token is past max_staleness at ``version``."""
        keep = []
        for g in self.groups:
            oldest = g.oldest()
            if oldest is None or version - oldest <= self.max_staleness:
                keep.append(g)
            elif self.stale == "drop":
                self.dropped += 1
            else:
                self.regenerated += 1
                keep.append(dataclasses.replace(g, admitted=version, samples=self._fresh(g.uid, version + 1)))
        self.groups = keep

    def ready(self) -> int:
        return sum(g.done() for g in self.groups)

    def urgent(self, version: int, wanted: int) -> frozenset[int]:
        """The groups (uids) past max_staleness at ``version`` + 1 unless a batch of ``version`` takes them: the
        ``wanted`` oldest of them, which the batch can hold."""
        late = [g for g in self.groups if (o := g.oldest()) is not None and version - o >= self.max_staleness]
        return frozenset(g.uid for g in sorted(late, key=_age)[:wanted])

    def can_take(self, wanted: int, version: int) -> bool:
        """Whether a batch of ``version`` is done: ``wanted`` groups, among them those ``urgent`` names."""
        done = {g.uid for g in self.groups if g.done()}
        return len(done) >= wanted and self.urgent(version, wanted) <= done

    def round(self, generate: Generate, params: SamplingParams, version: int,
              stop: Callable[[int], bool] = lambda ready: False, must: frozenset[int] = frozenset()) -> int:
        """Every unfinished sample goes on under the weights of ``version``: by a chunk (``chunk`` tokens), or
        (``chunk`` None) until ``stop(groups done)`` says so, asked after every engine step once the groups in
        ``must`` are done, and the engine aborts the rest. Returns the tokens generated. ``params``: the run's
        sampling (its n, seed and budget are the pool's to set)."""
        todo = [(g, s) for g in self.groups for s in g.samples if not s.done]
        if self.chunk is None:
            made = self._call(generate, params, todo, None, version, self._enough(todo, stop, must))
        else:
            by_budget: dict[int, list[tuple[Group, Partial]]] = {}
            for g, s in todo:
                by_budget.setdefault(min(self.chunk, self.budget - len(s.tokens)), []).append((g, s))
            made = sum(self._call(generate, params, items, limit, version, None)
                       for limit, items in sorted(by_budget.items()))
        self.finished([g for g in {id(g): g for g, _ in todo}.values() if g.done()])
        return made

    def _call(self, generate: Generate, params: SamplingParams, items: list[tuple[Group, Partial]],
              limit: int | None, version: int, enough: Enough | None) -> int:
        """One engine call for ``items``, each resumed from its prompt and tokens with ``limit`` more tokens at
        most (None: the rest of its budget); their new tokens joined to them. A sample whose last token is one of
        ``params.stop_token_ids`` is done whatever the engine's finish reason: SGLang reports "length" for a stop
        token that ends a chunk and "abort" for one an aborted request kept, and resuming it would generate, score
        and train text past its EOS (megarl.rollout.stops)."""
        seeds = None if params.seed is None else [self._chunk_seed(s) for _, s in items]
        left = [self.budget - len(s.tokens) for _, s in items]
        call = dataclasses.replace(params, n=1, max_new_tokens=self.budget if limit is None else limit, seed=None,
                                   seeds=seeds, budgets=left if limit is None else None)
        prompts = [g.prompt + s.tokens for g, s in items]
        out = generate(prompts, call) if enough is None else generate(prompts, call, enough)
        assert len(out) == len(items), "one completion per request"
        made, stop_ids = 0, frozenset(params.stop_token_ids)
        for c in out:
            g, s = items[c.prompt_index]
            s.tokens += c.token_ids
            s.logprobs += c.logprobs
            s.versions += [version] * len(c.token_ids)
            made += len(c.token_ids)
            stopped = c.finish_reason == "stop" or ends_in_stop(c.token_ids, stop_ids)
            if stopped or len(s.tokens) >= self.budget:
                s.done, s.truncated = True, not stopped
        return made

    def _enough(self, items: list[tuple[Group, Partial]], stop: Callable[[int], bool], must: frozenset[int]
                ) -> Enough:
        """``stop`` asked of the groups done, counting the requests of ``items`` finished in the call so far, once
        every group in ``must`` is done."""
        left = Counter(g.uid for g, _ in items)
        ready, seen, waiting = self.ready(), 0, len(must & set(left))

        def enough(finished: Sequence[int]) -> bool:
            nonlocal ready, seen, waiting
            for k in finished[seen:]:
                uid = items[k][0].uid
                left[uid] -= 1
                ready += left[uid] == 0
                waiting -= left[uid] == 0 and uid in must
            seen = len(finished)
            return waiting == 0 and stop(ready)

        return enough

    def _chunk_seed(self, s: Partial) -> int:
        """A sample's seed for its next chunk: its own, moved on by the tokens it has (no chunk replays another's
        random stream)."""
        assert s.seed is not None
        return (s.seed + 104729 * len(s.tokens)) % 2**31

    def fill(self, generate: Generate, params: SamplingParams, wanted: int, version: int,
             until_all: bool = False) -> int:
        """Rounds until ``wanted`` groups are done, among them every group that would be stale at the next version
        (every group, ``until_all``); returns the rounds run."""
        rounds, goal = 0, len(self.groups) if until_all else wanted
        must = frozenset() if until_all else self.urgent(version, wanted)
        while self.ready() < goal or any(not g.done() for g in self.groups if g.uid in must):
            if not any(not s.done for g in self.groups for s in g.samples):
                raise RuntimeError(f"{self.ready()} groups done, {wanted} wanted, none in flight: admit more first")
            self.round(generate, params, version, stop=lambda ready: ready >= goal, must=must)
            rounds += 1
        return rounds

    def take(self, wanted: int) -> list[Group]:
        """``wanted`` done groups, oldest token first, then in admission order, out of the pool."""
        taken = sorted((g for g in self.groups if g.done()), key=_age)[:wanted]
        assert len(taken) == wanted, f"{len(taken)} groups done, {wanted} wanted"
        uids = {g.uid for g in taken}
        self.groups = [g for g in self.groups if g.uid not in uids]
        self.taken += len(taken)
        return taken

    def metrics(self, taken: Sequence[Group], version: int) -> dict[str, float]:
        """async/*: the taken samples' staleness (versions behind ``version``, the weights that train them) at
        their oldest token, mean and max; versions a sample spans; the share of samples spanning several; the
        groups dropped or regenerated as stale since the last call; and what stays in flight."""
        samples = [s for g in taken for s in g.samples]
        lag = [version - min(s.versions) for s in samples if s.versions]
        spans = [len(set(s.versions)) for s in samples if s.versions]
        out = {"async/staleness_mean": sum(lag) / max(len(lag), 1), "async/staleness_max": float(max(lag, default=0)),
               "async/versions_per_sample": sum(spans) / max(len(spans), 1),
               "async/mixed_version_share": sum(x > 1 for x in spans) / max(len(spans), 1),
               "async/dropped_stale": float(self.dropped), "async/regenerated_stale": float(self.regenerated),
               "async/in_flight_prompts": float(len(self.groups)),
               "async/in_flight_tokens": float(sum(len(s.tokens) for g in self.groups for s in g.samples))}
        self.dropped = self.regenerated = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"groups": [dataclasses.asdict(g) for g in self.groups], "next_uid": self.next_uid,
                "taken": self.taken, "dropped": self.dropped, "regenerated": self.regenerated, "batch": self.batch}

    def load_state_dict(self, state: dict[str, Any], stop_ids: Collection[int] = ()) -> tuple[int, int]:
        """The pool of ``state_dict``; a sample that runs past one of ``stop_ids`` is cut after the first and done
        (a checkpoint written before the stop rule of ``_call`` may hold text past an EOS, which training would score
        and train on). A resume may change the batch and the group size (checkpoint.allow_changes): the groups taken
        so far count in batches of this pool's size, and a group of another size restarts from its prompt (GRPO
        would otherwise baseline other prompts' samples together). How many samples were cut, and groups
        restarted."""
        self.groups = [Group(**{**g, "samples": [Partial(**s) for s in g["samples"]]}) for g in state["groups"]]
        self.next_uid, self.dropped, self.regenerated = state["next_uid"], state["dropped"], state["regenerated"]
        self.taken = state["taken"] // state.get("batch", self.batch) * self.batch
        restarted = [g for g in self.groups if len(g.samples) != self.n]
        for g in restarted:
            g.samples = self._fresh(g.uid, 0)
        cut = 0
        for s in (s for g in self.groups for s in g.samples):
            first = next((i for i, t in enumerate(s.tokens) if t in stop_ids), None)
            if first is None or (first == len(s.tokens) - 1 and s.done and not s.truncated):
                continue
            del s.tokens[first + 1:], s.logprobs[first + 1:], s.versions[first + 1:]
            s.done, s.truncated = True, False
            cut += 1
        return cut, len(restarted)
