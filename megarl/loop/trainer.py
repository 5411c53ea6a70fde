"""One RL step: rollout -> reward -> reference/critic -> advantages -> updates -> reshard into the engine.

World layout: the trainer mesh (TP x PP x DP) and, colocated on the same GPUs, world / R engines
of R = ``rollout.tensor_parallel`` GPUs each (megarl.rollout.group): each engine's first rank drives
it and generates for the engine's share of the prompts, every rank hands its own engine rank's
weights over, and all ranks then see the whole batch.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist

from megarl.algos.kl import make_kl_controller
from megarl.algos.losses import token_weights
from megarl.algos.minibatches import mean_metrics, mini_batches
from megarl.algos.shaping import informative_groups
from megarl.config import Config, UpdateConfig, run_dir
from megarl.data.batching import TokenizedPrompt
from megarl.distributed.parallel import ParallelGroups
from megarl.loop.rl_step import Batch, actor_loss, check_scores, critic_loss, shaped_scores
from megarl.lora.handover import AdapterHandover
from megarl.lora.training import BaseModel, LoraAdapters
from megarl.memory.offload import PARTS, Part, Residency
from megarl.models.gpt import DTYPES, BuildOptions, layer_implementation, transformer_engine_available
from megarl.models.spec import load_spec
from megarl.models.trainable import MegatronModel
from megarl.reshard.aliasing import aliased_views, aliases_weights, share_aliases
from megarl.reshard.executor import Resharder, engine_tensor_allocations
from megarl.reshard.planner import LinkModel, make_plan
from megarl.reshard.predict import describe_plan
from megarl.rewards.registry import load_reward
from megarl.rollout.agent import agent_metrics, make_rollout
from megarl.rollout.base import Completion, SamplingParams
from megarl.rollout.factory import engine_class, make_engine
from megarl.rollout.group import GroupEngine, engine_group, start_engine


class RLTrainer:
    def __init__(self, cfg: Config, groups: ParallelGroups, stop_ids: tuple[int, ...] = (), tokenizer: Any = None):
        self.cfg, self.groups, self.stop_ids = cfg, groups, stop_ids
        self._rollout_loop = make_rollout(cfg, tokenizer)  # tools load and are checked before any model is built
        self._engine_state: Literal["asleep", "weights", "awake"] = "awake"  # engines start awake
        self._attached = False  # an in-engine hand-over maps the actor's tensors (megarl.reshard.handover)
        self._num_handovers = 0
        self._parts_s: defaultdict[str, float] = defaultdict(float)
        self.spec = load_spec(cfg.model.hf_path)
        # Each step's samples (tokens, logprobs and, with routing replay, every token's experts: hundreds of MB at
        # scale) reach every rank through host memory: an object gather over NCCL stages world x the largest part
        # on the GPU, next to the engine's KV cache.
        self._host_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        te = cfg.model.transformer_engine  # auto: local layers with LoRA, whose adapters hook them
        use_te = te == "on" or (te == "auto" and transformer_engine_available() and not cfg.actor.lora_on())
        m = cfg.model
        opts = BuildOptions(dtype=DTYPES[m.dtype], vocab_pad_multiple=m.vocab_pad_multiple, transformer_engine=use_te,
                            sequence_parallel=cfg.parallel.sequence_parallel, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
                            recompute_activations=m.recompute_activations, logprob_chunk_tokens=m.logprob_chunk_tokens)
        algo, steps = cfg.algorithm, cfg.trainer.num_steps
        rollout_batch = cfg.data.num_prompts_per_step * cfg.rollout.num_samples_per_prompt
        temperature = cfg.rollout.temperature  # log-probabilities of the distribution the engine samples from
        self.actor = MegatronModel(self.spec, cfg.model.hf_path, groups, opts, cfg.actor.optimizer, steps,
                                   temperature=temperature, routing_replay=algo.routing_replay,
                                   updates_per_step=cfg.actor.optimizer_steps(rollout_batch),
                                   adapters=LoraAdapters(cfg.actor.lora, seed=cfg.trainer.seed)
                                   if cfg.actor.lora is not None and cfg.actor.lora_on() else None)
        self.reference: MegatronModel | BaseModel | None = None
        if algo.kl_coef > 0:  # a LoRA actor's reference is the actor with its adapters off: no second copy
            self.reference = (BaseModel(self.actor) if cfg.actor.lora_on() else
                              MegatronModel(self.spec, cfg.model.hf_path, groups, opts, temperature=temperature))
        self.critic = None
        if algo.name == "ppo":
            critic_opts = dataclasses.replace(opts, critic=True)
            self.critic = MegatronModel(self.spec, cfg.critic.hf_path or cfg.model.hf_path, groups, critic_opts,
                                        cfg.critic.optimizer, steps,
                                        updates_per_step=cfg.critic.optimizer_steps(rollout_batch))
        if groups.rank == 0:
            print(f"megarl: {'Transformer Engine' if use_te else 'local'} layers "
                  f"({layer_implementation(self.actor.chunks)})", flush=True)
        self.kl = make_kl_controller(algo)
        self.reward_fn = load_reward(cfg.trainer.reward)
        # The plan places the engines (which GPUs form each, most bytes already local): made first.
        links = LinkModel(nvlink_gbps=cfg.parallel.nvlink_gbps, network_gbps=cfg.parallel.network_gbps)
        plan = make_plan(self.spec, groups.dims, cfg.rollout.tensor_parallel,
                         gpus_per_node=cfg.parallel.gpus_per_node
                         or int(os.environ.get("LOCAL_WORLD_SIZE", groups.dims.world_size)),
                         element_size=torch.finfo(DTYPES[cfg.model.dtype]).bits // 8,
                         bucket_bytes=cfg.rollout.reshard_bucket_mb * 2**20,
                         vocab_pad_multiple=cfg.model.vocab_pad_multiple, links=links)
        aliased = aliases_weights(cfg, self.spec, groups.dims, plan)
        self._weights_leave = cfg.actor.offload_weights and not aliased  # the engine then holds the only copy
        reference = {"reference": self.reference} if isinstance(self.reference, MegatronModel) else {}
        self.residency = Residency(self.trained_models() | reference,
                                   offloadable_parts(cfg, actor_weights_stay=bool(aliased)))
        self._hold("generate")  # the engine sizes itself next to what the trainer holds while it generates
        if groups.rank == 0:
            print(f"megarl: hand-over plan: {describe_plan(plan, predict=torch.cuda.is_available(), links=links)}",
                  flush=True)
            if aliased:
                print(f"megarl: the engine maps {aliased:.0%} of its weights from the actor's memory "
                      "(rollout.alias_weights): a hand-over copies only the rest, and the actor's weights stay on "
                      "the GPU during rollout", flush=True)
        group = engine_group(groups.rank, plan.engines())
        kind = engine_class(cfg)
        in_engine = kind.copies_in_engine
        views = aliased_views(plan, groups.rank, self.actor.named_params()) if aliased else {}
        alias_file = share_aliases(run_dir(cfg), group, kind, views) if aliased else None
        engine = start_engine(group, lambda: make_engine(cfg, group.index, group.devices(), alias_file),
                              cfg.rollout.timeout_minutes * 60)
        if alias_file is not None:
            alias_file.unlink()  # the engine's loader read it at start; its IPC handles mean nothing to anyone else
        self.engine = GroupEngine(group, engine, kind, timeout_s=cfg.rollout.timeout_minutes * 60)
        self.adapters = (AdapterHandover(self.actor, cfg.actor.lora, self.engine, run_dir(cfg))
                         if cfg.actor.adapter_handover() and cfg.actor.lora is not None else None)
        if self._weights_leave:
            self.sleep_engine()  # the hand-over needs the actor's weights back on the GPU, next to the engine's
        self._hold("handover")
        # An engine that copies in-engine reads the actor's tensors itself; others get engine-layout tensors.
        self._plan = plan
        self.engine_tensors = None if in_engine else self._allocate_engine_tensors()
        self.resharder = Resharder(plan, groups.rank, self.actor.named_params(), self.engine_tensors,
                                   in_engine=in_engine, landing_bytes=cfg.rollout.landing_buffer_mb * 2**20,
                                   aliased=set(views))
        if groups.rank == 0 and self.resharder.num_rounds > 1:
            print(f"megarl: each hand-over lands what other GPUs send in {self.resharder.num_rounds} rounds, one "
                  f"engine call each (rollout.landing_buffer_mb = {cfg.rollout.landing_buffer_mb})", flush=True)
        if self.adapters is not None and self.engine_tensors is not None:  # no engine-layout copy of the weights
            self.resharder.release()
            self.engine_tensors.clear()
        self.push_weights()
        self._parts_s.clear()  # steps report their own hand-overs, not the first one's start-up

    def _allocate_engine_tensors(self) -> dict[str, torch.Tensor]:
        return engine_tensor_allocations(self._plan, self.groups.rank, DTYPES[self.cfg.model.dtype],
                                         self.groups.device)

    def close(self) -> None:
        """Stop the engine before this process ends (its processes still map the actor's memory), and the tools."""
        self.engine.shutdown()
        self._rollout_loop.close()

    def sleep_engine(self) -> None:
        """Colocation: the trainer gets the engine's memory until the next push_weights."""
        if self._engine_state != "asleep":
            self.engine.sleep()
            self._engine_state = "asleep"

    def hold_for_checkpoint(self, role: str) -> None:
        """Before a checkpoint reads or writes ``role``: its whole state on the device, the rest offloaded
        (one model's state at a time, with the engine asleep)."""
        assert self._engine_state == "asleep", "checkpoints are written and read while the engine sleeps"
        self.residency.hold({"actor": {"weights"}, role: set(PARTS)})

    def step_metrics(self) -> dict[str, float]:
        """Since the last call: seconds spent moving state between device and host (inside the phases' times),
        the hand-over's parts (``handover/*_s``, inside time/reshard), the rollout's (``rollout/*_s``: engine,
        reward, sleep; inside time/generate) and, with routing replay, the share of expert choices the actor
        would have made otherwise."""
        seconds, self.residency.seconds = self.residency.seconds, 0.0
        parts, self._parts_s = self._parts_s, defaultdict(float)
        return ({"offload_seconds": seconds} | {f"{k}_s": v for k, v in parts.items()}
                | self.actor.routing_disagreement())

    @contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        """Add the wall time of ``part`` of a step (device work included) to its ``part``_s metric."""
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._parts_s[part] += time.perf_counter() - start

    def _hold(self, phase: str) -> None:
        """Keep on the device only what ``phase`` uses (megarl.memory.offload). Before the phases in which the engine
        takes memory (its weights wake for the hand-over, its KV cache for generation), what left and what the
        last phase cached go back to the driver: in torch's cache a colocated engine could not allocate them."""
        self.residency.hold(PHASE_NEEDS[phase])
        if phase in ("handover", "generate") and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # blocks the engine mapped until its detach
            torch.cuda.empty_cache()

    def trained_models(self) -> dict[str, MegatronModel]:
        """The models whose weights and optimizer state a checkpoint holds."""
        return {"actor": self.actor} | ({"critic": self.critic} if self.critic is not None else {})

    def push_weights(self) -> None:
        """Reshard the actor's current weights into the engine's layout and hand them over; the engine is
        awake after it. The engine's weights wake first, next to the actor's; with actor.offload_weights the
        actor's then leave the GPU (the resharder and the engine let go of their addresses), and only then
        does the engine's KV cache wake, in the room they leave."""
        if self._engine_state == "asleep":
            # the update's state (optimizer, grads) leaves, the actor's weights come back
            with self._timed("handover/hold"):
                self._hold("handover")
            with self._timed("handover/wake_weights"):
                self.engine.wake("weights")
            self._engine_state = "weights"
        with self._timed("handover/attach"):
            if self.engine.copies_in_engine and not self._attached:
                self.engine.attach(self.resharder.engine_copy())  # the actor's tensors where they are now
                self._attached = True
            if self.engine_tensors is not None and not self.engine_tensors and self.adapters is None:  # freed
                self.engine_tensors.update(self._allocate_engine_tensors())
        with self._timed("handover/copy"):
            if self.adapters is not None:  # LoRA, handover: adapter (the engine's base weights never change)
                self.adapters()
            else:
                self.actor.refresh_merged()  # LoRA: the engine gets W + s B A
                for round in range(self.resharder.num_rounds):  # the landing buffer holds one round (in-engine)
                    self.resharder.refit(round)
                    self.engine.deliver(self.engine_tensors, round)
        every = self.cfg.rollout.verify_every
        if every and self._num_handovers % every == 0 and self.adapters is None:
            with self._timed("handover/verify"):
                self.resharder.verify(self.engine, self._num_handovers)
        self._num_handovers += 1
        with self._timed("handover/release"):  # the actor's weights leave (actor.offload_weights), caches go back
            if self._weights_leave:
                if self._attached:
                    self.engine.detach()
                    self._attached = False
                self.resharder.release()
                if self.engine_tensors is not None:
                    self.engine_tensors.clear()  # the engine has loaded them: no copy of the weights stays
            if self._weights_leave or self._engine_state == "weights":
                self._hold("generate")  # also with the actor's weights kept: the update's cached memory must go
        if self._engine_state == "weights":
            with self._timed("handover/wake_cache"):
                self.engine.wake("cache")
        self._engine_state = "awake"

    def generate(self, next_prompts: Callable[[], list[TokenizedPrompt]], decode: Any, step: int
                 ) -> tuple[Batch, dict[str, float]]:
        """One step's batch of data.num_prompts_per_step prompts' samples, then the engine sleeps.

        With algorithm.dynamic_sampling, prompts whose samples all score the same (no GRPO signal) are
        dropped and further rounds of prompts generated, up to dynamic_sampling_max_rounds; a batch still
        short of informative prompts is filled up with dropped ones, which the actor's loss leaves out
        (Batch.informative). Every rank returns the same batch, and the step's sampling metrics (dynamic
        sampling's, the agent loop's).
        """
        algo, r = self.cfg.algorithm, self.cfg.rollout
        n, wanted = r.num_samples_per_prompt, self.cfg.data.num_prompts_per_step
        kept: list[Batch] = []
        dropped: list[Batch] = []
        num_kept = num_dropped = rounds = 0
        while num_kept < wanted and rounds < (algo.dynamic_sampling_max_rounds if algo.dynamic_sampling else 1):
            prompts = next_prompts()
            batch = self._rollout([p.tokens for p in prompts], [p.record.answer for p in prompts], decode, step,
                                  step * algo.dynamic_sampling_max_rounds + rounds)
            rounds += 1
            if not algo.dynamic_sampling:
                kept.append(batch)
                break
            good = informative_groups(shaped_scores(batch, algo, self.cfg.response_budget()), n).tolist()
            take = [g for g, ok in enumerate(good) if ok][: wanted - num_kept]
            skip = [g for g, ok in enumerate(good) if not ok]
            num_kept += len(take)
            num_dropped += len(skip)
            if take:
                kept.append(batch.select([g * n + j for g in take for j in range(n)]))
            if skip:
                dropped.append(batch.select([g * n + j for g in skip for j in range(n)]))
        with self._timed("rollout/sleep"):
            self.sleep_engine()
        metrics: dict[str, float] = {}
        if algo.dynamic_sampling:
            metrics = {"sampling/rounds": float(rounds), "sampling/informative_prompts": float(num_kept),
                       "sampling/dropped_prompts": float(num_dropped)}
            if num_kept < wanted:  # keep the configured batch size (mini-batches divide it): fill with no-signal groups
                filler = Batch.concat(dropped)
                kept.append(filler.select(range((wanted - num_kept) * n)).as_filler())
        batch = Batch.concat(kept)
        return batch, metrics | agent_metrics(batch.stats, batch.mask)

    def _rollout(self, prompts: list[list[int]], answers: list[str], decode: Any, step: int, seed_offset: int
                 ) -> Batch:
        """The prompts' samples, scored; every rank returns the whole batch (samples of one prompt contiguous)."""
        r = self.cfg.rollout
        # Each round's samples take the next range of seeds (100003 apart, as runs always have, unless more).
        stride = max(100003, len(prompts) * r.num_samples_per_prompt)
        params = SamplingParams(n=r.num_samples_per_prompt, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_new_tokens, seed=r.seed + seed_offset * stride,
                                stop_token_ids=self.stop_ids)
        with self._timed("rollout/engine"):
            rows = self.generate_all(prompts, params)
        with self._timed("rollout/reward"):
            scores = self.reward_fn([decode(c.token_ids) for c in rows], [answers[c.prompt_index] for c in rows])
        check_scores(scores, len(rows), self.cfg.trainer.reward, step)
        routing: Any = [c.routed_experts for c in rows] if self.cfg.algorithm.routing_replay else None
        return Batch.build([prompts[c.prompt_index] for c in rows], [c.token_ids for c in rows],
                           [c.logprobs for c in rows], scores, routing, [c.policy_mask for c in rows],
                           [c.stats for c in rows])

    def generate_all(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` samples of every prompt on every rank, grouped in prompt order; engine i's driver samples
        prompts i, i + number of engines, ... (EngineGroup.share: each sample at params.seed + its place)."""
        assert self._engine_state == "awake", "push_weights() wakes the engine before every rollout"
        mine, seeded = self.engine.group.share(len(prompts), params)
        done = [dataclasses.replace(c, prompt_index=mine[c.prompt_index])
                for c in self._rollout_loop.generate(self.engine, [prompts[i] for i in mine], seeded)]
        everything: list[Any] = [None] * self.groups.dims.world_size
        dist.all_gather_object(everything, done, group=self._host_group)
        return sorted((c for part in everything for c in part), key=lambda c: c.prompt_index)  # stable per prompt

    def score(self, batch: Batch, model: MegatronModel | BaseModel | None) -> torch.Tensor | None:
        """Logprobs (actor/reference) or values (critic) of the batch as [N, T] on every rank; each
        data-parallel replica scores its share of the sequences."""
        if model is None:
            return None
        self._hold("values" if model is self.critic else "score" if not isinstance(model, MegatronModel)
                   or model is self.actor else "reference")
        section = self.cfg.critic if model is self.critic else self.cfg.actor
        g = self.groups
        mine = list(range(g.dp_rank, len(batch.sequences), g.dims.dp))
        rows = model.score([batch.sequences[i] for i in mine], *_batching(section),
                           routing=_routing(model, batch, mine))
        return self._share_rows(dict(zip(mine, rows, strict=True)) if rows is not None else None, batch)

    def _optimize(self, model: MegatronModel, section: UpdateConfig, batch: Batch, extras: dict[str, torch.Tensor],
                  loss: Any, where: str, step: int, mask: torch.Tensor) -> dict[str, float]:
        """``num_ppo_epochs`` passes over the batch in shuffled mini-batches of ``mini_batch_size`` samples
        (megarl.algos.minibatches), one optimizer step each. Token weights are normalised per mini-batch over all
        DP ranks, over the tokens of ``mask`` [N, T] (response tokens that count in the loss), so each step
        optimises the configured aggregation of its mini-batch; each DP rank trains on its share."""
        g, n, aggregation = self.groups, len(batch.sequences), self.cfg.algorithm.loss_aggregation
        steps: list[dict[str, float]] = []
        for epoch in range(section.num_ppo_epochs):
            parts = mini_batches(n, section.mini_batch_size or n, self.cfg.trainer.seed, step, epoch)
            for part, index in enumerate(parts):
                weights = token_weights(mask[index], aggregation, self.cfg.rollout.max_new_tokens)
                mine = list(range(g.dp_rank, len(index), g.dims.dp))
                seqs = [batch.sequences[index[j]] for j in mine]
                rows = {k: [v[index[j], : len(seqs[m]) - 1] for m, j in enumerate(mine)] for k, v in extras.items()}
                rows["weights"] = [weights[j, : len(seqs[m]) - 1] for m, j in enumerate(mine)]
                steps.append(model.train_step(seqs, rows, loss, *_batching(section),
                                              where=f"{where}, epoch {epoch}, mini-batch {part + 1} of {len(parts)}",
                                              routing=_routing(model, batch, [index[j] for j in mine])))
        return mean_metrics(steps)

    def update_actor(self, batch: Batch, extras: dict[str, torch.Tensor], step: int, mask: torch.Tensor
                     ) -> dict[str, float]:
        """Clipped policy updates; extras: old_logprobs, advantages[, ref_logprobs][, is_weights] as [N, T];
        ``mask`` [N, T]: the response tokens the loss counts (rl_step.actor_loss_mask)."""
        algo, actor = self.cfg.algorithm, self.actor
        entropy_on = algo.entropy_coef > 0

        def loss(logits: torch.Tensor, tokens: torch.Tensor, ex: dict[str, torch.Tensor]) -> Any:
            logp = actor.token_logprobs(logits, tokens)
            return actor_loss(logp, ex, algo, self.kl.value, actor.token_entropy(logits) if entropy_on else None)

        self._hold("actor_update")
        metrics = self._optimize(actor, self.cfg.actor, batch, extras, loss, f"step {step}, actor", step, mask)
        return {f"actor/{k}": v for k, v in metrics.items()}

    def update_critic(self, batch: Batch, extras: dict[str, torch.Tensor], step: int, mask: torch.Tensor
                      ) -> dict[str, float]:
        """Clipped value updates; extras: old_values, returns as [N, T]; ``mask`` [N, T]: the tokens the loss counts
        (rl_step.critic_loss_mask)."""
        if self.critic is None:
            return {}
        algo = self.cfg.algorithm
        self._hold("critic_update")
        metrics = self._optimize(self.critic, self.cfg.critic, batch, extras,
                                 lambda out, tok, ex: critic_loss(out[:, :-1, 0].float(), ex, algo),
                                 f"step {step}, critic", step, mask)
        return {f"critic/{k}": v for k, v in metrics.items()}

    def _share_rows(self, rows: dict[int, torch.Tensor] | None, batch: Batch) -> torch.Tensor:
        """Each DP replica's last pipeline stage holds its sequences' rows (by batch index); give every
        rank the whole [N, T] tensor."""
        g = self.groups
        out = batch.stack(rows or {}).to(g.device)  # NCCL takes CUDA tensors only
        if g.dims.dp > 1:
            dist.all_reduce(out, group=g.dp_group)  # replicas hold disjoint rows
        if g.dims.pp > 1:
            dist.broadcast(out, src=dist.get_global_rank(g.pp_group, g.dims.pp - 1), group=g.pp_group)
        return out.cpu()


PHASE_NEEDS: dict[str, dict[str, set[Part]]] = {
    "handover": {"actor": {"weights"}},
    "generate": {},  # the engine alone (the actor's weights too stay unless actor.offload_weights, or aliased)
    "score": {"actor": {"weights"}},
    "reference": {"actor": {"weights"}, "reference": {"weights"}},
    "values": {"actor": {"weights"}, "critic": {"weights"}},
    "actor_update": {"actor": {"weights", "grads", "optimizer"}},
    "critic_update": {"actor": {"weights"}, "critic": {"weights", "grads", "optimizer"}},
}
"""What each phase of a step uses; the rest may leave the device (``offloadable_parts``)."""


def offloadable_parts(cfg: Config, actor_weights_stay: bool = False) -> dict[str, set[Part]]:
    """Per model, the parts its config lets leave the device. Gradient buffers always may: they are
    freed, not copied (every update zeroes them first). ``actor_weights_stay``: the engine maps them
    (rollout.alias_weights), so they never move."""
    grads: set[Part] = {"grads"}
    optimizer: set[Part] = {"optimizer"}
    weights: set[Part] = {"weights"}
    return {"actor": grads | (optimizer if cfg.actor.offload_optimizer else set())
            | (weights if cfg.actor.offload_weights and not actor_weights_stay else set()),
            "critic": grads | (optimizer if cfg.critic.offload_optimizer else set())
            | (weights if cfg.critic.offload_weights else set()),
            "reference": weights if cfg.reference.offload_weights else set()}


def _routing(model: MegatronModel | BaseModel, batch: Batch, index: list[int]) -> list[Any] | None:
    """The engine's expert choices for the samples at ``index`` if ``model`` replays them (routing replay)."""
    if model.replay is None:
        return None
    assert batch.routing is not None, "routing replay without the engine's routing"
    return [batch.routing[i] for i in index]


def _batching(section: UpdateConfig) -> tuple[int | None, int]:
    """(max_tokens, micro_batch_size) for MegatronModel: a token budget, or fixed micro-batches."""
    return (section.max_tokens_per_gpu if section.dynamic_batch else None), section.micro_batch_size
