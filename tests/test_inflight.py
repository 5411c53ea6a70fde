"""async_rl's pool of partial rollouts (megarl.rollout.inflight) and separate's generation thread
(megarl.rollout.producer) against a scripted engine whose samples stop at random lengths and whose calls take
random times, as real ones do: the staleness bound holds for every sample of every batch, no prompt is trained
twice or lost, a push never overlaps a round, a hung or failed engine is a named error, and a pool saved mid-run
and loaded again goes on exactly as the uninterrupted one."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from collections import Counter

import pytest

from megarl.errors import UserError
from megarl.rollout.base import Completion, SamplingParams, request_budget
from megarl.rollout.inflight import InFlight
from megarl.rollout.producer import Producer


def cut_at_enough(out: list[Completion], enough) -> list[Completion]:
    """generate_until's abort over whole completions: every request makes a token per engine step, and once
    ``enough(finished so far)`` says so, the unfinished ones come back cut there (finish_reason "abort")."""
    finished: list[int] = []
    for t in range(1, max((len(c.token_ids) for c in out), default=0) + 1):
        finished += [c.prompt_index for c in out if len(c.token_ids) == t]
        if len(finished) < len(out) and enough(finished):
            return [c if len(c.token_ids) <= t else
                    Completion(prompt_index=c.prompt_index, token_ids=c.token_ids[:t], logprobs=c.logprobs[:t],
                               finish_reason="abort") for c in out]
    return out


class ScriptedEngine:
    """Each request's tokens depend only on its seed and its prompt: a token is the running count, its logprob a
    draw, and the sample stops at each token with probability ``stop``."""

    def __init__(self, stop: float) -> None:
        self.stop, self.calls, self.aborted = stop, 0, 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, enough=None) -> list[Completion]:
        """With ``enough``: generate_until, every request a token per engine step, the rest aborted when it says."""
        self.calls += 1
        out = []
        for i, prompt in enumerate(prompts):
            seed = params.seeds[i] if params.seeds is not None else 0
            rng = random.Random(hash((seed, tuple(prompt))))
            tokens, finish = [], "length"
            while len(tokens) < request_budget(params, i):
                tokens.append(len(prompt) + len(tokens))
                if rng.random() < self.stop:
                    finish = "stop"
                    break
            out.append(Completion(prompt_index=i, token_ids=tokens, logprobs=[-rng.random() for _ in tokens],
                                  finish_reason=finish))
        if enough is None:
            return out
        cut = cut_at_enough(out, enough)
        self.aborted += sum(len(a.token_ids) > len(b.token_ids) for a, b in zip(out, cut, strict=True))
        return cut


def run(pool: InFlight, engine: ScriptedEngine, steps: range, wanted: int, prompts: list[list[int]],
        cursor: list[int]) -> list[tuple[int, list]]:
    """The colocated_async loop's rollout side for ``steps``: expire, admit whole steps of prompts, fill, take."""
    taken = []
    params = SamplingParams(temperature=1.0, seed=5)
    for step in steps:
        pool.expire(step)
        while pool.room(step) >= wanted:
            pool.admit([(prompts[i], str(i)) for i in range(cursor[0], cursor[0] + wanted)], step)
            cursor[0] += wanted
        pool.fill(engine.generate, params, wanted, step)
        taken.append((step, pool.take(wanted)))
    return taken


class LengthEngine:
    """A request's sample is ``lengths[prompt[0]]`` tokens long in all: a slow group among fast ones."""

    def __init__(self, lengths: dict[int, int]) -> None:
        self.lengths = lengths

    def generate(self, prompts: list[list[int]], params: SamplingParams, enough=None) -> list[Completion]:
        out = []
        for i, prompt in enumerate(prompts):
            left = self.lengths[prompt[0]] - (len(prompt) - 1)
            made = min(left, request_budget(params, i))
            out.append(Completion(prompt_index=i, token_ids=[1] * made, logprobs=[-0.5] * made,
                                  finish_reason="stop" if made == left else "length"))
        return out if enough is None else cut_at_enough(out, enough)


@pytest.mark.parametrize("chunk", [3, None])
def test_a_group_about_to_go_stale_is_waited_for_not_dropped(chunk):
    """Group 0 needs 30 tokens, every other group 2. Step 0 takes two fast groups; at step 1 group 0's oldest token
    is one version old and would be past max_staleness 1 at step 2: step 1 waits for it and trains it, instead of
    taking a fresh fast group and dropping it a step later."""
    pool = InFlight(n=2, budget=40, chunk=chunk, max_staleness=1, batch=2, capacity=4, stale="drop", seed=3)
    engine = LengthEngine({100: 30} | {100 + k: 2 for k in range(1, 40)})
    prompts = [[100 + k] for k in range(40)]
    taken = run(pool, engine, range(4), 2, prompts, [0])
    assert [int(g.answer) for g in taken[0][1]] == [1, 2]
    assert 0 in [int(g.answer) for g in taken[1][1]]
    slow = next(g for g in taken[1][1] if g.answer == "0")
    assert {v for s in slow.samples for v in s.versions} == {0, 1} and all(len(s.tokens) == 30 for s in slow.samples)
    assert pool.metrics([], 4)["async/dropped_stale"] == 0
    assert [int(g.answer) for _, groups in taken for g in groups] == [1, 2, 0, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("seed", range(12))
def test_no_batch_holds_a_token_older_than_the_bound_and_no_prompt_is_trained_twice(seed):
    rng = random.Random(seed)
    staleness, wanted, n = rng.choice([1, 2, 3]), rng.choice([2, 4]), rng.choice([2, 4])
    stale = rng.choice(["drop", "regenerate"])
    prompts = [[7] * rng.randint(1, 9) for _ in range(400)]
    chunk = rng.choice([3, 8, None])  # None: the engine aborts the unfinished samples once a batch is done
    told: dict[int, list[list[int]]] = {}  # what the reward scored early, by group
    times_told: Counter[int] = Counter()

    def finished(groups):
        for g in groups:
            assert g.done()
            told[g.uid] = [list(s.tokens) for s in g.samples]
            times_told[g.uid] += 1

    pool = InFlight(n=n, budget=40, chunk=chunk, max_staleness=staleness, batch=wanted,
                    capacity=(staleness + 1) * wanted, stale=stale, seed=11, finished=finished)
    cursor = [0]
    engine = ScriptedEngine(stop=rng.choice([0.02, 0.1]))
    taken = run(pool, engine, range(20), wanted, prompts, cursor)
    assert chunk is not None or engine.stop < 0.1 or engine.aborted > 0  # at 0.02, most samples run to the budget
    trained = [int(g.answer) for _, groups in taken for g in groups]
    assert len(trained) == len(set(trained)) == 20 * wanted
    dropped = pool.metrics([], 20)["async/dropped_stale"]
    assert len(trained) + len(pool.groups) + dropped == cursor[0]  # every admitted prompt accounted for
    lags = []
    for step, groups in taken:
        for g in groups:
            for s in g.samples:
                assert s.done and 1 <= len(s.tokens) <= 40 and len(s.logprobs) == len(s.versions) == len(s.tokens)
                assert s.versions == sorted(s.versions) and s.versions[-1] <= step
                assert not s.truncated or len(s.tokens) == 40
                lags.append(step - s.versions[0])
    assert max(lags) <= staleness
    # Every trained group was scored early on exactly the samples it trains, and once (unless regenerated).
    assert all(told[g.uid] == [s.tokens for s in g.samples] for _, groups in taken for g in groups)
    assert stale == "regenerate" or max(times_told.values()) == 1
    if staleness > 1:  # samples do carry over: the bound is reached, not avoided
        assert max(lags) >= 1


def test_a_pool_saved_mid_run_goes_on_as_the_uninterrupted_one():
    prompts = [[3] * (1 + i % 7) for i in range(200)]

    def make() -> InFlight:
        return InFlight(n=4, budget=30, chunk=4, max_staleness=2, batch=4, capacity=12, stale="regenerate", seed=3)

    whole, cursor = make(), [0]
    expected = run(whole, ScriptedEngine(stop=0.05), range(10), 4, prompts, cursor)
    first, cursor2 = make(), [0]
    got = run(first, ScriptedEngine(stop=0.05), range(4), 4, prompts, cursor2)
    state = json.loads(json.dumps(first.state_dict()))  # as trainer.json holds it
    assert any(s["tokens"] and not s["done"] for g in state["groups"] for s in g["samples"])  # cut mid-response
    assert any(len(set(s["versions"])) > 1 for g in state["groups"] for s in g["samples"])  # across versions
    second = make()
    second.load_state_dict(state)
    got += run(second, ScriptedEngine(stop=0.05), range(4, 10), 4, prompts, cursor2)
    assert cursor2 == cursor
    assert [(step, [(g.uid, [(s.tokens, s.logprobs, s.versions) for s in g.samples]) for g in groups])
            for step, groups in got] == \
           [(step, [(g.uid, [(s.tokens, s.logprobs, s.versions) for s in g.samples]) for g in groups])
            for step, groups in expected]


@pytest.mark.parametrize("n, wanted", [(4, 4), (2, 2), (2, 6)])
def test_a_resume_that_changes_the_group_size_or_the_batch_trains_whole_groups_of_every_prompt_once(n, wanted):
    """checkpoint.allow_changes may name rollout.num_samples_per_prompt and data.num_prompts_per_step. A restored
    group of the old size mixed prompts in GRPO's groups (or crashed it); the old count of groups taken against the
    new batch admitted nothing more, and the run stopped a step later with "none in flight"."""
    prompts = [[3] * (1 + i % 7) for i in range(400)]
    first, cursor = InFlight(n=2, budget=30, chunk=4, max_staleness=2, batch=4, capacity=12, stale="drop",
                             seed=3), [0]
    got = run(first, ScriptedEngine(stop=0.05), range(5), 4, prompts, cursor)
    state = json.loads(json.dumps(first.state_dict()))
    assert any(s["tokens"] and not s["done"] for g in state["groups"] for s in g["samples"])
    second = InFlight(n=n, budget=30, chunk=4, max_staleness=2, batch=wanted, capacity=3 * wanted, stale="drop",
                      seed=3)
    assert second.load_state_dict(state)[1] == (len(state["groups"]) if n != 2 else 0)
    later = run(second, ScriptedEngine(stop=0.05), range(5, 12), wanted, prompts, cursor)
    assert all(len(groups) == wanted and all(len(g.samples) == n for g in groups) for _, groups in later)
    trained = [g.uid for _, groups in got + later for g in groups]
    assert len(trained) == len(set(trained)) == 5 * 4 + 7 * wanted


def test_metrics_count_staleness_versions_and_what_stays_in_flight():
    pool = InFlight(n=2, budget=10, chunk=4, max_staleness=2, batch=1, capacity=4, stale="drop", seed=0)
    pool.admit([([1], "a"), ([2], "b")], version=0)
    pool.groups[0].samples[0].tokens, pool.groups[0].samples[0].versions = [5, 6, 7], [0, 0, 1]
    pool.groups[0].samples[1].tokens, pool.groups[0].samples[1].versions = [5], [2]
    pool.groups[1].samples[1].tokens, pool.groups[1].samples[1].versions = [9, 9], [0, 0]
    pool.expire(3)  # group b's oldest token is 3 versions old: dropped; a's is too
    assert pool.groups == [] and pool.metrics([], 3)["async/dropped_stale"] == 2
    pool.admit([([1], "c")], version=3)
    pool.groups[0].samples[0].tokens, pool.groups[0].samples[0].versions = [5, 6, 7], [2, 2, 3]
    pool.groups[0].samples[1].tokens, pool.groups[0].samples[1].versions = [5], [3]
    m = pool.metrics(pool.groups, 4)
    assert m["async/staleness_mean"] == 1.5 and m["async/staleness_max"] == 2
    assert m["async/versions_per_sample"] == 1.5 and m["async/mixed_version_share"] == 0.5
    assert m["async/dropped_stale"] == 0 and m["async/in_flight_prompts"] == 1 and m["async/in_flight_tokens"] == 4


class SlowEngine(ScriptedEngine):
    """The scripted engine, taking a random while per call, that fails the test if a weight push overlaps a call."""

    def __init__(self, stop: float, seed: int) -> None:
        super().__init__(stop)
        self.rng, self.pushing = random.Random(seed), False

    def generate(self, prompts: list[list[int]], params: SamplingParams, enough=None) -> list[Completion]:
        assert not self.pushing, "a round ran during a weight push"
        time.sleep(self.rng.uniform(0, 0.004))
        if enough is not None:  # an engine step takes a while, and a pause is asked for meanwhile
            def slow(finished):
                time.sleep(self.rng.uniform(0, 0.0005))
                return enough(finished)
        out = super().generate(prompts, params, None if enough is None else slow)
        assert not self.pushing, "a weight push began during a round"
        return out


@pytest.mark.parametrize("seed", range(9))
def test_separate_generation_keeps_the_bound_whatever_the_timing(seed):
    """async_rl separate: the producer thread generates while the 'learner' sleeps a random while per step; a
    push pauses it between rounds. Timing decides how stale each batch is, never beyond the bound."""
    rng = random.Random(seed)
    staleness, wanted = rng.choice([1, 2]), 3
    pool = InFlight(n=2, budget=12, chunk=rng.choice([2, 5, None]), max_staleness=staleness, batch=wanted,
                    capacity=(staleness + 1) * wanted, stale=rng.choice(["drop", "regenerate"]), seed=1)
    engine, cursor = SlowEngine(stop=0.1, seed=seed), [0]

    def admit(version: int) -> None:
        while pool.room(version) >= wanted:
            pool.admit([([5] * (1 + (cursor[0] + i) % 4), str(cursor[0] + i)) for i in range(wanted)], version)
            cursor[0] += wanted

    producer = Producer(pool, engine.generate, SamplingParams(seed=3), admit, timeout_s=30)
    producer.start(0)
    trained: list[int] = []
    try:
        for step in range(25):
            groups, metrics = producer.take(wanted, step)
            assert all(step - s.versions[0] <= staleness for g in groups for s in g.samples)
            assert metrics["async/staleness_max"] <= staleness and metrics["async/generation_cpu_s"] >= 0
            trained += [int(g.answer) for g in groups]
            time.sleep(rng.uniform(0, 0.01))  # the update
            with producer.pushing(wanted):
                engine.pushing = True
                time.sleep(0.001)
                engine.pushing = False
    finally:
        producer.close()
    assert producer.error is None
    assert len(trained) == len(set(trained)) == 25 * wanted
    assert pool.dropped == pool.regenerated == 0


@pytest.mark.parametrize("chunk", [2, None])
def test_separate_waits_for_a_group_about_to_go_stale_instead_of_dropping_it(chunk):
    """async_rl separate, max_staleness 1: prompt 0 needs 60 tokens, every other one 2. Step 1's batch waits for
    prompt 0, whose oldest token would be past the bound at step 2, and trains it; before, step 1 took two fresh fast
    groups and prompt 0 was dropped at the next push: the long answers are the ones a run would never train on."""
    wanted = 2
    pool = InFlight(n=1, budget=60, chunk=chunk, max_staleness=1, batch=wanted, capacity=2 * wanted, stale="drop",
                    seed=1)
    engine, cursor = LengthEngine({k: 60 if k == 0 else 2 for k in range(100)}), [0]

    def admit(version: int) -> None:
        while pool.room(version) >= wanted:
            pool.admit([([cursor[0] + i], str(cursor[0] + i)) for i in range(wanted)], version)
            cursor[0] += wanted

    def generate(prompts, params, enough=None):
        time.sleep(0.003)  # the learner's steps overlap rounds, as with a real engine
        return engine.generate(prompts, params, enough)

    producer = Producer(pool, generate, SamplingParams(seed=3), admit, timeout_s=30)
    producer.start(0)
    trained: list[list[int]] = []
    try:
        for step in range(6):
            groups, metrics = producer.take(wanted, step)
            assert metrics["async/staleness_max"] <= 1
            trained.append([int(g.answer) for g in groups])
            time.sleep(0.02)  # the update
            with producer.pushing(wanted):
                pass
    finally:
        producer.close()
    assert producer.error is None and pool.dropped == pool.regenerated == 0
    assert 0 in trained[0] + trained[1] and sorted(sum(trained, [])) == list(range(12)), trained


class TwoRanks:
    """Two training processes' generation threads, in one process: their agreement (an all-reduce of the largest
    value) and one engine driven by rank 0 whose samples both ranks receive, as a round's gather gives them. A round
    whose ranks ask for different samples fails the run, as diverging pools would."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine, self.barrier, self.box, self.out = engine, threading.Barrier(2, timeout=60), [None, None], None

    def agree(self, rank: int):
        def agree(values: list[int]) -> list[int]:
            self.box[rank] = values
            self.barrier.wait()
            out = [max(a, b) for a, b in zip(*self.box, strict=True)]
            self.barrier.wait()
            return out
        return agree

    def generate(self, rank: int):
        def generate(prompts, params, enough=None):
            self.box[rank] = (prompts, params)
            self.barrier.wait()
            same = self.box[0] == self.box[1]
            if rank == 0 and same:
                self.out = self.engine.generate(prompts, params, enough)
            self.barrier.wait()
            assert same, "the ranks' threads ran different rounds"
            return copy.deepcopy(self.out)
        return generate


@pytest.mark.parametrize("seed", range(6))
def test_the_ranks_threads_take_the_same_batches_whenever_each_learner_asks(seed):
    """async_rl separate over two training processes: each rank's learner asks for its batches, pushes and
    checkpoints at its own pace (random sleeps, different on each rank); every rank's thread runs the same rounds,
    and every rank trains the same groups and saves the same pool, within the staleness bound."""
    rng = random.Random(seed)
    staleness, wanted, steps = rng.choice([1, 2]), 3, 12
    ranks = TwoRanks(SlowEngine(stop=0.1, seed=seed))
    chunk, stale = rng.choice([2, 5, None]), rng.choice(["drop", "regenerate"])
    pools = [InFlight(n=2, budget=12, chunk=chunk, max_staleness=staleness, batch=wanted,
                      capacity=(staleness + 1) * wanted, stale=stale, seed=1) for _ in range(2)]
    trained: list[list] = [[], []]
    saved: list[list[str]] = [[], []]

    def admitting(pool: InFlight):
        cursor = [0]

        def admit(version: int) -> None:
            while pool.room(version) >= wanted:
                pool.admit([([5] * (1 + (cursor[0] + i) % 4), str(cursor[0] + i)) for i in range(wanted)], version)
                cursor[0] += wanted
        return admit

    producers = [Producer(pools[r], ranks.generate(r), SamplingParams(seed=3), admitting(pools[r]), timeout_s=30,
                          agree=ranks.agree(r)) for r in range(2)]

    def learner(rank: int) -> None:
        pace, producer = random.Random(seed * 10 + rank), producers[rank]
        for step in range(steps):
            groups, metrics = producer.take(wanted, step)
            assert metrics["async/staleness_max"] <= staleness
            trained[rank].append([(g.answer, [(s.tokens, s.versions) for s in g.samples]) for g in groups])
            time.sleep(pace.uniform(0, 0.01))  # the update
            if step % 4 == 3:
                with producer.paused("the checkpoint"):
                    saved[rank].append(json.dumps(pools[rank].state_dict()))
            with producer.pushing(wanted):
                time.sleep(pace.uniform(0, 0.003))

    for p in producers:
        p.start(0)
    learners = [threading.Thread(target=learner, args=(r,)) for r in range(2)]
    for t in learners:
        t.start()
    for t in learners:
        t.join(120)
    assert not any(t.is_alive() for t in learners), "a rank's learner still waits"
    closing = [threading.Thread(target=p.close) for p in producers]  # each rank closes its own
    for t in closing:
        t.start()
    for t in closing:
        t.join(60)
    assert [p.error for p in producers] == [None, None]
    assert len(trained[0]) == steps and trained[0] == trained[1]
    assert saved[0] == saved[1] and len(saved[0]) == steps // 4
    answers = [a for batch in trained[0] for a, _ in batch]
    assert len(answers) == len(set(answers)) == steps * wanted


def test_a_batch_done_when_a_push_ends_is_taken_in_its_pause_not_by_cutting_a_round():
    """separate without chunks: every pause cuts the engine's round, whose unfinished samples are prefilled again.
    A batch already done when a push ends is taken in the push's pause: after the first step, one pause a step."""
    wanted = 2
    pool = InFlight(n=2, budget=6, chunk=None, max_staleness=1, batch=wanted, capacity=2 * wanted, stale="drop",
                    seed=1)
    engine, cursor = ScriptedEngine(stop=0.3), [0]

    def admit(version: int) -> None:
        while pool.room(version) >= wanted:
            pool.admit([([5, cursor[0] + i], str(cursor[0] + i)) for i in range(wanted)], version)
            cursor[0] += wanted

    producer = Producer(pool, engine.generate, SamplingParams(seed=3), admit, timeout_s=30)
    asked: list[str] = []
    post = producer._post
    producer._post = lambda request: (asked.append(request.what or request.kind), post(request))[1]  # type: ignore[method-assign]
    producer.start(0)
    trained: list[int] = []
    try:
        for step in range(6):
            groups, metrics = producer.take(wanted, step)
            assert metrics["async/staleness_max"] <= 1
            trained += [int(g.answer) for g in groups]
            deadline = time.monotonic() + 30  # the update outlasts the next batch's generation
            while pool.ready() < wanted and time.monotonic() < deadline:
                time.sleep(0.001)
            with producer.pushing(wanted):
                pass
    finally:
        producer.close()
    assert producer.error is None
    assert asked == ["take"] + ["the weight push"] * 6 + ["stop"]
    assert trained == list(range(12))


def test_a_hung_or_failed_engine_round_is_a_named_error_not_a_hang():
    release = threading.Event()

    def hung(prompts, params):
        release.wait(10)
        raise RuntimeError("engine process died")

    pool = InFlight(n=1, budget=4, chunk=4, max_staleness=1, batch=1, capacity=2, stale="drop", seed=None)
    producer = Producer(pool, hung, SamplingParams(), lambda v: pool.admit([([1], "a")], v) if not pool.groups
                        else None, timeout_s=0.3)
    producer.start(0)
    time.sleep(0.1)
    with pytest.raises(UserError, match=r"the weight push: the engine's round in progress did not end in 0.3 s"):
        with producer.paused("the weight push"):
            pass
    release.set()  # the engine's call now fails: the next wait names its error
    time.sleep(0.1)
    with pytest.raises(RuntimeError, match="engine process died"):
        producer.take(1, 0)
    producer.close()


def _past_the_last_batch(then, timeout_s: float) -> tuple[Producer, list[int]]:
    """A producer whose learner took its last batch (one prompt, answered by the engine's first call) and pushed;
    the engine's later calls, rounds for a step that never comes, run ``then()`` first. The engine's calls too."""
    calls: list[int] = []

    def generate(prompts, params):
        calls.append(len(prompts))
        if len(calls) > 1:
            then()
        return [Completion(prompt_index=i, token_ids=[1], logprobs=[-0.1], finish_reason="stop")
                for i in range(len(prompts))]

    pool = InFlight(n=1, budget=4, chunk=4, max_staleness=1, batch=1, capacity=2, stale="drop", seed=None)
    admitted = iter(range(100))
    producer = Producer(pool, generate, SamplingParams(), lambda v: pool.admit(
        [([1], str(next(admitted))) for _ in range(pool.room(v))], v), timeout_s=timeout_s)
    producer.start(0)
    assert [g.answer for g in producer.take(1, 0)[0]] == ["0"]
    with producer.pushing(1):  # the last step's push
        pass
    return producer, calls


def test_an_engine_that_fails_after_the_last_batch_is_named_when_the_run_closes():
    """The learner takes its last batch and pushes; the thread's next round fails. No later request meets the
    error, so closing the producer (the end of the run) raises it: the run does not end as a success with a dead
    engine unreported."""

    def die():
        raise RuntimeError("engine process died")

    producer, _ = _past_the_last_batch(die, timeout_s=5)
    for _ in range(500):
        if producer.error is not None:
            break
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="engine process died"):
        producer.close()


def test_an_engine_that_hangs_after_the_last_batch_is_named_when_the_run_closes():
    """The round after the last batch never returns: closing waits rollout.timeout_minutes for it, then names the
    hung engine instead of ending the run as a success with the thread still inside the engine."""
    hang = threading.Event()
    producer, calls = _past_the_last_batch(lambda: hang.wait(30), timeout_s=0.5)
    for _ in range(500):
        if len(calls) > 1:
            break
        time.sleep(0.01)
    try:
        with pytest.raises(UserError, match="did not end in 0.5 s"):
            producer.close()
    finally:
        hang.set()


def test_async_layouts_the_run_cannot_serve_are_refused_before_any_worker(tmp_path):
    from helpers import REPO
    from megarl.config.yaml_io import FieldError
    from megarl.loop.bootstrap import check_run

    recipe, common = str(REPO / "recipes/tiny_cpu_grpo.yaml"), [f"checkpoint.dir={tmp_path}",
                                                                 "algorithm.rollout_correction=token_tis"]
    aborting = [*common, "async_rl.mode=colocated_async", "async_rl.chunk_tokens=null"]
    with pytest.raises(FieldError, match=r"async_rl.chunk_tokens` = null, but it must be set with 2 engines"):
        check_run(recipe, aborting, world=2, ranks_per_node=None, gpu_bytes=0)
    with pytest.raises(FieldError, match=r"async_rl.chunk_tokens` = null, but it must be set with 2 engines"):
        check_run(recipe, [*common, "async_rl.mode=separate", "async_rl.chunk_tokens=null"], world=2,
                  ranks_per_node=None, gpu_bytes=0)
    separate = [*common, "async_rl.mode=separate", "async_rl.chunk_tokens=2"]
    assert check_run(recipe, separate, world=2, ranks_per_node=None, gpu_bytes=0)[0].async_rl.mode == "separate"
    assert check_run(recipe, aborting, world=1, ranks_per_node=None, gpu_bytes=0)[0].async_rl.chunk_tokens is None
    # engines on GPUs of their own: an equal share of the trainer's ranks drives each, on one node
    with pytest.raises(FieldError, match=r"engine_gpus` = 2, but it must make a number of engines .* that divides "
                                         r"the trainer's 3 ranks.*use 3"):
        check_run(recipe, [*separate, "async_rl.engine_gpus=2"], world=3, ranks_per_node=None, gpu_bytes=0)
    with pytest.raises(FieldError, match=r"engine_gpus` = 2, but it must be 0 over 2 nodes"):
        check_run(recipe, [*separate, "async_rl.engine_gpus=2"], world=2, ranks_per_node=1, gpu_bytes=0)
    # one engine, however many ranks: no chunks needed for its abort to see the whole batch
    apart = [*common, "async_rl.mode=separate", "async_rl.chunk_tokens=null", "async_rl.engine_gpus=1"]
    assert check_run(recipe, apart, world=2, ranks_per_node=None, gpu_bytes=0)[0].num_engines(2) == 1


def test_max_staleness_0_runs_the_sync_loops_rollout_itself():
    """No sample outlives its step, so the sync loop's rollout runs unchanged: its batches are the sync loop's, bit
    for bit (through train.py, measured identical over 6 steps when both ran)."""
    from megarl.config import build_config
    from megarl.loop.partial_rollouts import carries_samples

    def cfg(**async_rl):
        return build_config({"model": {"hf_path": "m"}, "data": {"train_path": "x.jsonl"}, "async_rl": async_rl,
                             "algorithm": {"rollout_correction": "token_tis"}})

    assert not carries_samples(cfg()) and not carries_samples(cfg(mode="colocated_async", max_staleness=0))
    assert carries_samples(cfg(mode="colocated_async")) and carries_samples(cfg(mode="separate", max_staleness=2))


def test_chunks_without_the_radix_cache_are_named_at_start_up():
    """Chunked rounds with SGLang's radix cache off prefill every prefix again (3x the engine's time per token on
    GSM8K on an H200): start-up says so; not for the sync loop, vLLM, the engine's abort or the cache on."""
    from helpers import REPO
    from megarl.config import load_config
    from megarl.loop.partial_rollouts import prefill_note

    recipe = REPO / "recipes/smollm2_gsm8k_grpo.yaml"  # SGLang, disable_radix_cache: true
    chunked = ["async_rl.mode=colocated_async", "algorithm.rollout_correction=token_tis"]
    note = prefill_note(load_config(recipe, chunked))
    assert note is not None and "disable_radix_cache" in note and "async_rl.chunk_tokens" in note
    assert prefill_note(load_config(recipe)) is None
    assert prefill_note(load_config(recipe, [*chunked, "rollout.engine_args.disable_radix_cache=false"])) is None
    assert prefill_note(load_config(recipe, [*chunked, "rollout.engine=vllm", "rollout.engine_args={}"])) is None
    assert prefill_note(load_config(recipe, [*chunked, "async_rl.max_staleness=0"])) is None


def test_separate_on_a_gpu_without_mps_is_named_at_start_up(tmp_path):
    """Without an MPS daemon the engine's and the learner's kernels take turns on the shared GPU (1.31x against
    1.55x under MPS on an H200): start-up says so, only for separate on CUDA, and not once the daemon's control
    pipe is where CUDA's clients look for it."""
    import os

    from helpers import REPO
    from megarl.config import load_config
    from megarl.loop.partial_rollouts import mps_note

    recipe = REPO / "recipes/smollm2_gsm8k_grpo.yaml"
    separate = load_config(recipe, ["async_rl.mode=separate", "algorithm.rollout_correction=token_tis"])
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    note = mps_note(separate, on_cuda=True, environ=env)
    assert note is not None and "nvidia-cuda-mps-control -d" in note and str(tmp_path) in note
    assert mps_note(separate, on_cuda=False, environ=env) is None
    assert mps_note(load_config(recipe), on_cuda=True, environ=env) is None
    os.mkfifo(tmp_path / "control")
    assert mps_note(separate, on_cuda=True, environ=env) is None


EOS = 2


class SGLangOrderEngine:
    """Finishes a request as SGLang does: an abort first, then the budget, then a stop token, checked after each
    token. ``scripts[prompt[0]]`` is the response the model writes (its EOS included); a request resumed past it
    writes token 9s, as a model resumed after its EOS would write text. Every request decodes a token per engine
    step; once ``enough`` says so, the rest are aborted and each decodes the one more token SGLang lets it keep."""

    def __init__(self, scripts: dict[int, list[int]]) -> None:
        self.scripts, self.calls = scripts, 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, enough=None) -> list[Completion]:
        self.calls += 1
        made: list[list[int]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * len(prompts)
        finished: list[int] = []
        aborting = False
        while None in finish:
            for i, prompt in enumerate(prompts):
                if finish[i] is not None:
                    continue
                at, script = len(prompt) - 1 + len(made[i]), self.scripts[prompt[0]]
                made[i].append(script[at] if at < len(script) else 9)
                if aborting:
                    finish[i] = "abort"
                elif len(made[i]) >= request_budget(params, i):
                    finish[i] = "length"
                elif made[i][-1] in params.stop_token_ids:
                    finish[i] = "stop"
                if finish[i] in ("length", "stop"):
                    finished.append(i)
            aborting = aborting or (enough is not None and None in finish and enough(finished))
        return [Completion(prompt_index=i, token_ids=t, logprobs=[-0.5] * len(t), finish_reason=f)  # type: ignore[arg-type]
                for i, (t, f) in enumerate(zip(made, finish, strict=True))]


def test_a_chunk_that_ends_on_eos_completes_the_sample_on_an_engine_that_says_length():
    """SGLang reports "length" for an EOS that is a chunk's last token: the sample is complete there, not resumed
    into text after its EOS (which would be scored, trained and counted in its length)."""
    pool = InFlight(n=2, budget=9, chunk=3, max_staleness=1, batch=1, capacity=2, stale="drop", seed=1)
    pool.admit([([100], "a"), ([101], "b")], 0)
    engine = SGLangOrderEngine({100: [7, 7, EOS], 101: [7, 7, 7, 7, 7, EOS]})
    pool.fill(engine.generate, SamplingParams(seed=3, stop_token_ids=[EOS]), 2, 0)
    taken = {g.answer: [s.tokens for s in g.samples] for g in pool.take(2)}
    assert taken == {"a": [[7, 7, EOS]] * 2, "b": [[7, 7, 7, 7, 7, EOS]] * 2}


def test_an_aborted_request_that_kept_an_eos_is_complete():
    """Without chunks SGLang aborts the rest once a batch is done, and a running request keeps the token it
    decodes meanwhile: when that token is EOS the sample is complete, not resumed past it at the next step."""
    pool = InFlight(n=1, budget=9, chunk=None, max_staleness=1, batch=1, capacity=2, stale="drop", seed=1)
    pool.admit([([100], "fast"), ([101], "slow")], 0)
    engine = SGLangOrderEngine({100: [EOS], 101: [7, EOS]})
    params = SamplingParams(seed=3, stop_token_ids=[EOS])
    pool.fill(engine.generate, params, 1, 0)
    assert [g.answer for g in pool.take(1)] == ["fast"]
    slow = pool.groups[0].samples[0]
    assert (slow.tokens, slow.done, slow.truncated) == ([7, EOS], True, False)
    pool.fill(engine.generate, params, 1, 1)
    assert engine.calls == 1 and pool.take(1)[0].samples[0].tokens == [7, EOS]


def test_a_sample_cut_by_its_budget_is_truncated_and_one_that_ends_on_eos_there_is_not():
    pool = InFlight(n=1, budget=3, chunk=2, max_staleness=1, batch=2, capacity=2, stale="drop", seed=1)
    pool.admit([([100], "eos"), ([101], "cut")], 0)
    pool.fill(SGLangOrderEngine({100: [7, 7, EOS], 101: [7, 7, 7, EOS]}).generate,
              SamplingParams(seed=3, stop_token_ids=[EOS]), 2, 0)
    assert {g.answer: (g.samples[0].tokens, g.samples[0].truncated) for g in pool.take(2)} == \
        {"eos": ([7, 7, EOS], False), "cut": ([7, 7, 7], True)}


def test_a_checkpoints_pool_with_samples_past_their_eos_is_cut_at_it_on_resume():
    """A checkpoint written before the stop rule may hold samples resumed past their EOS (done or still in flight)
    and ones SGLang left "length"/"abort" on an EOS: the resumed pool ends each at its first EOS, complete, with its
    logprobs and versions cut alike; a sample that stopped there, or holds no EOS, is untouched."""
    pool = InFlight(n=1, budget=9, chunk=2, max_staleness=2, batch=1, capacity=8, stale="drop", seed=1)
    pool.admit([([100 + i], str(i)) for i in range(5)], 0)
    tokens = {"0": ([7, EOS, 9, 9], True, True),  # resumed past its EOS to its budget: done, "truncated"
              "1": ([7, EOS, 9], False, False),  # resumed past its EOS, still in flight
              "2": ([7, 7, EOS], False, False),  # a chunk ended on EOS, SGLang said "length"
              "3": ([7, EOS], True, False),  # stopped at EOS: as it should be
              "4": ([7, 7], False, False)}  # in flight, no EOS yet
    for g in pool.groups:
        s = g.samples[0]
        s.tokens, s.done, s.truncated = list(tokens[g.answer][0]), tokens[g.answer][1], tokens[g.answer][2]
        s.logprobs, s.versions = [-0.5] * len(s.tokens), list(range(len(s.tokens)))
    state = json.loads(json.dumps(pool.state_dict()))
    resumed = InFlight(n=1, budget=9, chunk=2, max_staleness=2, batch=1, capacity=8, stale="drop", seed=1)
    assert resumed.load_state_dict(state, frozenset([EOS])) == (3, 0)
    got = {g.answer: (g.samples[0].tokens, g.samples[0].done, g.samples[0].truncated, g.samples[0].logprobs,
                      g.samples[0].versions) for g in resumed.groups}
    assert got == {"0": ([7, EOS], True, False, [-0.5] * 2, [0, 1]), "1": ([7, EOS], True, False, [-0.5] * 2, [0, 1]),
                   "2": ([7, 7, EOS], True, False, [-0.5] * 3, [0, 1, 2]),
                   "3": ([7, EOS], True, False, [-0.5] * 2, [0, 1]), "4": ([7, 7], False, False, [-0.5] * 2, [0, 1])}


def test_a_push_that_fails_halfway_ends_generation_before_a_round_reads_the_half_written_weights():
    """separate: a push that fails after writing part of the new weights (a worker that died, a copy that raised)
    ends the run with its error; the generation thread, released from the push's pause, starts no round on the
    engine's mix of old and new weights, whose tokens would carry the old version."""
    wanted, cursor = 1, [0]
    pool = InFlight(n=1, budget=10**6, chunk=1, max_staleness=1, batch=wanted, capacity=2, stale="drop", seed=1)
    engine, half_written, read = LengthEngine({0: 1} | {k: 10**6 for k in range(1, 9)}), [False], []

    def generate(prompts, params, enough=None):
        read.append(half_written[0])
        time.sleep(0.001)
        return engine.generate(prompts, params, enough)

    def admit(version: int) -> None:
        while pool.room(version) >= wanted:
            pool.admit([([cursor[0]], str(cursor[0]))], version)
            cursor[0] += 1

    producer = Producer(pool, generate, SamplingParams(seed=3), admit, timeout_s=30)
    producer.start(0)
    assert [g.answer for g in producer.take(wanted, 0)[0]] == ["0"]  # prompt 1 generates on, without end
    with pytest.raises(RuntimeError, match="worker died"):
        with producer.pushing(wanted):
            half_written[0] = True
            raise RuntimeError("the engine's worker died halfway through the push")
    time.sleep(0.1)  # rounds, had they gone on
    assert True not in read and producer.version == 0
    producer.close()  # the run ends with the push's error, not a second one


def test_a_separate_resume_from_a_checkpoint_taken_mid_generation_trains_every_prompt_once():
    """separate's checkpoint pauses the generation thread, saves the pool and the data cursor, and generation goes on
    until the push. A run resumed from it regenerates what was made after the checkpoint, under the next version:
    its samples may differ from the uninterrupted run's, but it trains every prompt the uninterrupted run trains,
    none twice, and each batch within the staleness bound."""
    wanted, steps, saved_at = 2, 8, 3

    def run_steps(pool: InFlight, cursor: list[int], first: int, last: int, snapshot=None) -> list[int]:
        def admit(version: int) -> None:
            while pool.room(version) >= wanted:
                pool.admit([([5] * (1 + (cursor[0] + i) % 3), str(cursor[0] + i)) for i in range(wanted)], version)
                cursor[0] += wanted

        engine = SlowEngine(stop=0.05, seed=first)
        producer = Producer(pool, engine.generate, SamplingParams(seed=3), admit, timeout_s=30)
        producer.start(first)
        trained: list[int] = []
        try:
            for step in range(first, last):
                groups, metrics = producer.take(wanted, step)
                assert metrics["async/staleness_max"] <= 1
                trained += [int(g.answer) for g in groups]
                if step == saved_at and snapshot is not None:
                    with producer.paused("the checkpoint"):  # as RolloutManager.snapshot reads them
                        snapshot.update(pool=json.loads(json.dumps(pool.state_dict())), cursor=cursor[0])
                    time.sleep(0.02)  # generation goes on between the checkpoint and the push
                with producer.pushing(wanted):
                    pass
        finally:
            producer.close()
        assert producer.error is None
        return trained

    def make() -> InFlight:
        return InFlight(n=2, budget=40, chunk=2, max_staleness=1, batch=wanted, capacity=2 * wanted, stale="drop",
                        seed=1)

    snapshot: dict = {}
    whole = run_steps(make(), [0], 0, steps, snapshot)
    assert any(not s["done"] for g in snapshot["pool"]["groups"] for s in g["samples"])  # cut mid-generation
    resumed_pool = make()
    resumed_pool.load_state_dict(snapshot["pool"])
    resumed = whole[:(saved_at + 1) * wanted] + run_steps(resumed_pool, [snapshot["cursor"]], saved_at + 1, steps)
    assert len(resumed) == len(set(resumed)) == steps * wanted
    assert sorted(resumed) == sorted(whole) == list(range(steps * wanted))


def test_an_engine_killed_mid_round_is_named_and_leaves_the_pool_as_the_last_whole_call_made_it():
    """colocated_async: the engine dies in a round's second call (one call per budget left). Its error is what the
    run ends with (EngineFailed: one paragraph, exit 2), no token of the failed call is joined, and the pool still
    holds every admitted group, so the samples a checkpoint holds are whole and none is lost or doubled."""
    from megarl.rollout.failures import EngineFailed

    pool = InFlight(n=2, budget=5, chunk=3, max_staleness=1, batch=2, capacity=4, stale="drop", seed=1)
    pool.admit([([1], "a"), ([2], "b")], 0)
    params = SamplingParams(seed=3)
    pool.round(LengthEngine({1: 4, 2: 5}).generate, params, 0)  # 3 tokens each: budgets of 2 left
    pool.admit([([3], "c")], 0)  # a fresh group: a budget of 3, so the round makes two calls
    calls: list[int] = []

    def dies_second(prompts, params, enough=None):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise EngineFailed("the rollout engine failed during generate: its scheduler process was killed")
        return LengthEngine({1: 4, 2: 5, 3: 9}).generate(prompts, params, enough)

    with pytest.raises(EngineFailed, match="scheduler process was killed"):
        pool.round(dies_second, params, 1)
    state = pool.state_dict()
    assert [g["answer"] for g in state["groups"]] == ["a", "b", "c"]
    lengths = {g["answer"]: [len(s["tokens"]) for s in g["samples"]] for g in state["groups"]}
    assert lengths == {"a": [4, 4], "b": [5, 5], "c": [0, 0]}  # a, b: the first call; c: untouched
    assert all(len(s["versions"]) == len(s["tokens"]) == len(s["logprobs"])
               for g in state["groups"] for s in g["samples"])
