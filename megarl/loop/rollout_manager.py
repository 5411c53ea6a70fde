"""The rollout side: the engines (started, put to sleep, woken), generation of a step's batch (dynamic sampling's
rounds included, or async_rl's partial rollouts carried across steps), the agent loop's tools, and the reward
(with async_rl, each group scored as soon as its samples are done)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from megarl.algos.shaping import informative_groups
from megarl.config import Config
from megarl.data.batching import TokenizedPrompt
from megarl.data.tokenizer import decoder
from megarl.distributed.parallel import ParallelGroups
from megarl.errors import UserError
from megarl.loop.partial_rollouts import PartialRollouts, carries_samples
from megarl.loop.rl_step import Batch, shaped_scores
from megarl.loop.timing import PartTimes
from megarl.rewards.scorer import RewardScorer
from megarl.rewards.text import reads_tool_turns, reward_text
from megarl.rollout.agent import agent_metrics, make_rollout
from megarl.rollout.base import Completion, Enough, SamplingParams
from megarl.rollout.factory import make_engine
from megarl.rollout.failures import EngineFailed
from megarl.rollout.group import EngineGroup, GroupEngine, start_engine
from megarl.rollout.inflight import Group

EngineState = Literal["asleep", "weights", "awake"]


class RolloutManager:
    def __init__(self, cfg: Config, groups: ParallelGroups, stop_ids: tuple[int, ...], tokenizer: Any,
                 times: PartTimes) -> None:
        self.cfg, self.groups, self.times = cfg, groups, times
        # The tokenizer's and the model's own EOS ids (bootstrap.stop_ids): async_rl's pool completes a sample by
        # them whatever finish reason the engine gives (megarl.rollout.stops).
        self.stop_ids = stop_ids
        self._rollout_loop = make_rollout(cfg, tokenizer)  # tools load and are checked before any model is built
        self.scorer = RewardScorer(cfg.trainer.reward, cfg.trainer.reward_workers)
        self.decode = decoder(tokenizer)
        self._early: dict[int, Future[list[float]]] = {}
        """async_rl: the scores of groups done in the pool, by uid, computed while the engine goes on."""
        # Each step's samples (tokens, logprobs and, with routing replay, every token's experts: hundreds of MB at
        # scale) reach every rank through host memory: an object gather over NCCL stages world x the largest part
        # on the GPU, next to the engine's KV cache.
        self._host_group = None if dist.get_backend() == "gloo" else \
            dist.new_group(backend="gloo", timeout=cfg.host_group_timeout())
        self.engine: GroupEngine | Any = None
        self.state: EngineState = "awake"  # engines start awake
        self.separate = cfg.async_rl.mode == "separate"
        """The engine never sleeps: it generates while the learner trains."""
        # separate: the generation thread's own collectives (a round's gather, the threads' agreement), beside the
        # learner's (a gloo group's calls are ordered by the thread that makes them); each waits at most as long as
        # an engine call may take.
        self._thread_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=cfg.rollout.timeout_minutes)) \
            if self.separate and groups.dims.world_size > 1 else None
        self.partial = PartialRollouts(cfg, self.stop_ids, times, self._score_early,
                                       self._agree if self._thread_group is not None else None) \
            if carries_samples(cfg) else None

    def start(self, group: EngineGroup, kind: Any, aliases: Path | None) -> None:
        """Start this rank's engine group's engine (``aliases``: its parameters that map the actor's memory)."""
        cfg = self.cfg
        engine = start_engine(group, lambda: make_engine(cfg, group.index, group.devices(), aliases),
                              cfg.rollout.timeout_minutes * 60)
        self.engine = GroupEngine(group, engine, kind, timeout_s=cfg.rollout.timeout_minutes * 60)

    def close(self) -> None:
        """Stop the engine before this process ends (its processes still map the actor's memory), and the tools."""
        if self.partial is not None:
            self.partial.close()
        self.engine.shutdown()
        self._rollout_loop.close()
        self.scorer.close()

    def sleep(self) -> None:
        """Colocation: the trainer gets the engine's memory until the next hand-over wakes it."""
        if self.state != "asleep" and not self.separate:
            self.engine.sleep()
            self.state = "asleep"

    def wake(self, part: Literal["weights", "cache"]) -> None:
        """The engine's weights (for a hand-over), then its KV cache (for generation)."""
        self.engine.wake(part)
        self.state = "weights" if part == "weights" else "awake"

    def generate(self, next_prompts: Callable[[], list[TokenizedPrompt]], step: int) -> tuple[Batch, dict[str, float]]:
        """One step's batch of data.num_prompts_per_step prompts' samples, then the engine sleeps.

        With algorithm.dynamic_sampling, prompts whose samples all score the same (no GRPO signal) are
        dropped and further rounds of prompts generated, up to dynamic_sampling_max_rounds; a batch still
        short of informative prompts is filled up with dropped ones, which the actor's loss leaves out
        (Batch.informative). Every rank returns the same batch, and the step's sampling metrics (dynamic
        sampling's, the agent loop's).
        """
        if self.partial is not None:
            taken, pool_metrics = self.partial.take(self._generate_beside if self.separate else self._generate_all,
                                                    next_prompts, step)
            with self.times.timed("rollout/sleep"):
                self.sleep()
            return self._scored(taken, step), pool_metrics
        algo, r = self.cfg.algorithm, self.cfg.rollout
        n, wanted = r.num_samples_per_prompt, self.cfg.data.num_prompts_per_step
        kept: list[Batch] = []
        dropped: list[Batch] = []
        num_kept = num_dropped = num_surplus = rounds = 0
        drawn: list[torch.Tensor] = []  # every round's scores: the policy's, where reward_mean is the batch's
        while num_kept < wanted and rounds < (algo.dynamic_sampling_max_rounds if algo.dynamic_sampling else 1):
            prompts = next_prompts()
            batch = self._rollout([p.tokens for p in prompts], [p.record.answer for p in prompts],
                                  step * algo.dynamic_sampling_max_rounds + rounds)
            rounds += 1
            if not algo.dynamic_sampling:
                kept.append(batch)
                break
            drawn.append(batch.scores)
            good = informative_groups(shaped_scores(batch, algo, self.cfg.response_budget()), n).tolist()
            informative = [g for g, ok in enumerate(good) if ok]
            take = informative[: wanted - num_kept]
            skip = [g for g, ok in enumerate(good) if not ok]
            num_kept += len(take)
            num_dropped += len(skip)
            num_surplus += len(informative) - len(take)
            if take:
                kept.append(batch.select([g * n + j for g in take for j in range(n)]))
            if skip:
                dropped.append(batch.select([g * n + j for g in skip for j in range(n)]))
        with self.times.timed("rollout/sleep"):
            self.sleep()
        metrics: dict[str, float] = {}
        if algo.dynamic_sampling:
            # reward_mean is the trained batch's, which the filter shapes (two samples a prompt: 0.5 whatever the
            # policy does): the mean over every sample drawn is the policy's; informative prompts past the batch's
            # need are generated and left unused.
            metrics = {"sampling/rounds": float(rounds), "sampling/informative_prompts": float(num_kept),
                       "sampling/dropped_prompts": float(num_dropped), "sampling/surplus_prompts": float(num_surplus),
                       "sampling/reward_mean_drawn": float(torch.cat(drawn).mean())}
            if num_kept < wanted:  # keep the configured batch size (mini-batches divide it): fill with no-signal groups
                filler = Batch.concat(dropped)
                kept.append(filler.select(range((wanted - num_kept) * n)).as_filler())
        batch = Batch.concat(kept)
        return batch, metrics | agent_metrics(batch.stats, batch.mask)

    def _mine(self, group: Group) -> bool:
        """Whether this rank scores ``group`` (every rank holds the same pool; each scores every world_size-th
        group)."""
        return group.uid % self.groups.dims.world_size == self.groups.rank

    def _score_early(self, groups: list[Group]) -> None:
        """Groups a round finished: scored by a reward worker while the engine generates the rest (without
        workers, now: in separate's generation thread, still off the learner's path)."""
        for g in filter(self._mine, groups):
            self._early[g.uid] = self.scorer.submit([self.decode(s.tokens) for s in g.samples],
                                                    [g.answer] * len(g.samples))

    def _scored(self, taken: list[Group], step: int) -> Batch:
        """async_rl: the batch of the groups a step takes, scored, with the tokens of older weights marked."""
        samples = [(g, s) for g in taken for s in g.samples]
        with self.times.timed("rollout/reward"):
            mine = list(filter(self._mine, taken))
            late = [g for g in mine if g.uid not in self._early]  # restored by a resume: not scored yet

            def score_mine() -> dict[int, list[float]]:
                now = iter(self.scorer([self.decode(s.tokens) for g in late for s in g.samples],
                                       [g.answer for g in late for _ in g.samples]) if late else [])
                return {g.uid: self.scorer.result(self._early.pop(g.uid)) if g.uid in self._early
                        else [next(now) for _ in g.samples] for g in mine}

            shares = every_rank_or_stop(score_mine, self.groups.dims.world_size, self._host_group, UserError, str,
                                        UserError)
            scored = {uid: part for share in shares for uid, part in share.items()}
            scores = [x for g in taken for x in scored[g.uid]]
            assert self.partial is not None
            # separate: the generation thread goes on meanwhile, admitting groups and scoring those it finishes, so
            # both are read through copies (a dict iterated while another thread inserts raises)
            live = {g.uid for g in list(self.partial.pool.groups)}
            for uid in [uid for uid in list(self._early) if uid not in live]:  # dropped as stale
                self._early.pop(uid, None)
        batch = Batch.build([g.prompt for g, _ in samples], [s.tokens for _, s in samples],
                            [s.logprobs for _, s in samples], scores)
        batch.current = batch.stack({i: torch.tensor([0.0] * (len(g.prompt) - 1) + [float(v == step)
                                                                                 for v in s.versions])
                                     for i, (g, s) in enumerate(samples)})
        return batch

    def _generate_beside(self, prompts: list[list[int]], params: SamplingParams, enough: Enough | None = None
                         ) -> list[Completion]:
        """generate_all from separate's thread, beside the learner's collectives (over its own group)."""
        return self._generate_all(prompts, params, enough, group=self._thread_group)

    def _agree(self, values: list[int]) -> list[int]:
        """separate over several processes: each value's largest over the ranks, for their generation threads."""
        agreed = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._thread_group)
        return agreed.tolist()

    def pushing(self) -> Any:
        """Around a weight push (separate: generation pauses between chunks for it)."""
        return self.partial.pushing() if self.partial is not None else nullcontext()

    def snapshot(self, loader: Any) -> dict[str, Any]:
        """What a checkpoint keeps of the rollout side, read together: the data loader's cursor and the samples in
        flight (async_rl)."""
        with self.partial.consistent() if self.partial is not None else nullcontext():
            return {"loader": loader.state_dict(),
                    "rollout": {} if self.partial is None else {"in_flight": self.partial.state_dict()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.partial is not None and "in_flight" in state:
            self.partial.load_state_dict(state["in_flight"])

    def _rollout(self, prompts: list[list[int]], answers: list[str], seed_offset: int) -> Batch:
        """The prompts' samples, scored; every rank returns the whole batch (samples of one prompt contiguous)."""
        r = self.cfg.rollout
        # Each round's samples take the next range of seeds (100003 apart, as runs always have, unless more).
        stride = max(100003, len(prompts) * r.num_samples_per_prompt)
        params = SamplingParams(n=r.num_samples_per_prompt, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_new_tokens, seed=r.seed + seed_offset * stride,
                                stop_token_ids=self.stop_ids)
        with self.times.timed("rollout/engine"):
            rows = self.generate_all(prompts, params)
        with self.times.timed("rollout/reward"):
            scores = self._score_shares(rows, answers)
        routing: Any = [c.routed_experts for c in rows] if self.cfg.algorithm.routing_replay else None
        return Batch.build([prompts[c.prompt_index] for c in rows], [c.token_ids for c in rows],
                           [c.logprobs for c in rows], scores, routing, [c.policy_mask for c in rows],
                           [c.stats for c in rows])

    def _score_shares(self, rows: list[Completion], answers: list[str]) -> list[float]:
        """Every row's score on every rank, each rank scoring every world_size-th row: no sample is scored twice, and
        every rank trains on the same scores."""
        world, rank = self.groups.dims.world_size, self.groups.rank
        mine = rows[rank::world]
        tool_turns = reads_tool_turns(self.scorer)
        scores = [0.0] * len(rows)

        def score_mine() -> list[float]:
            return self.scorer([reward_text(self.decode, c.token_ids, c.policy_mask, tool_turns) for c in mine],
                               [answers[c.prompt_index] for c in mine]) if mine else []

        # A reward's bad return (a UserError, checked where it returns) stops every rank with the same paragraph.
        shares = every_rank_or_stop(score_mine, world, self._host_group, UserError, str, UserError)
        for r, share in enumerate(shares):
            scores[r::world] = share
        return scores

    def generate_all(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` samples of every prompt on every rank, grouped in prompt order; engine i's driver samples
        prompts i, i + number of engines, ... (EngineGroup.share: each sample at params.seed + its place). With
        async_rl separate, the generation thread pauses meanwhile (an evaluation's calls)."""
        producer = None if self.partial is None else self.partial.producer
        with producer.paused("the evaluation") if producer is not None else nullcontext():
            return self._generate_all(prompts, params)

    def _generate_all(self, prompts: list[list[int]], params: SamplingParams, enough: Enough | None = None, *,
                      group: dist.ProcessGroup | None = None) -> list[Completion]:
        """``enough``: the engine aborts (async_rl.chunk_tokens null), which needs one engine in the world: its
        driver alone sees which requests are done (megarl.loop.bootstrap). ``group``: the gloo group that gathers
        the samples (the learner's host group by default)."""
        assert self.state == "awake", "a hand-over wakes the engine before every rollout"
        mine, seeded = self.engine.group.share(len(prompts), params)
        assert enough is None or self.engine.group.num_groups == 1, "generate_until runs on one engine"
        mine_prompts = [prompts[i] for i in mine]

        def made() -> list[Completion]:
            done = (self._rollout_loop.generate(self.engine, mine_prompts, seeded) if enough is None
                    else self.engine.generate_until(mine_prompts, seeded, enough))
            return [dataclasses.replace(c, prompt_index=mine[c.prompt_index]) for c in done]

        def failed(err: Exception) -> str:
            return (f"rank {self.groups.rank}'s rollout engine failed, so this rank stops too: "
                    f"{' '.join(str(err).split())[:1500]}")

        # An engine's failure stops every rank alike: separate's generation threads would otherwise wait for this
        # rank's part, and their learners for their batches, until the deadline.
        everything = every_rank_or_stop(made, self.groups.dims.world_size, group or self._host_group, Exception,
                                        failed, EngineFailed)
        return sorted((c for part in everything for c in part), key=lambda c: c.prompt_index)  # stable per prompt


@dataclasses.dataclass(frozen=True)
class _Stopped:
    """A rank's part when making it raised: the message every other rank raises."""

    message: str


def every_rank_or_stop(make: Callable[[], Any], world_size: int, group: dist.ProcessGroup | None,
                       catching: type[Exception], describe: Callable[[Exception], str],
                       stop: Callable[[str], Exception]) -> list[Any]:
    """``make()``'s result from every rank (``every_rank``). Where ``make`` raises ``catching`` on one rank, that
    rank raises it and every other rank raises ``stop(describe(err))``: otherwise they would wait in the gather for
    its part until the deadline."""
    try:
        part = make()
    except catching as err:
        if world_size > 1:
            every_rank(_Stopped(describe(err)), world_size, group)
        raise
    everything = every_rank(part, world_size, group)
    stopped = [p for p in everything if isinstance(p, _Stopped)]
    if stopped:
        raise stop(stopped[0].message)
    return everything


def every_rank(part: Any, world_size: int, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``part``, in rank order, through host memory (a gloo ``group``; None: the default group)."""
    if world_size == 1:
        return [part]
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, part, group=group)
    return parts
