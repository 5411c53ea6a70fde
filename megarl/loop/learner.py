"""The learner: the actor, the critic, the reference, a distillation teacher and a reward model, what each holds on
the device in each phase, scoring a batch, and the clipped updates of its epochs x mini-batches."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from megarl.algos.kl import make_kl_controller
from megarl.algos.losses import token_weights
from megarl.algos.minibatches import mean_metrics, mini_batches
from megarl.checkpoint import manifest
from megarl.config import Config, UpdateConfig
from megarl.distributed.parallel import ParallelGroups
from megarl.errors import UserError
from megarl.loop.rl_step import Batch, actor_loss, critic_loss
from megarl.lora.training import BaseModel, LoraAdapters
from megarl.memory.offload import PARTS, Part, Residency
from megarl.models.critic_init import critic_weights
from megarl.models.gpt import DTYPES, BuildOptions, layer_implementation, transformer_engine_available
from megarl.models.reward_model import RewardModel, load_reward_spec, scores_on_every_rank
from megarl.models.spec import ModelSpec, load_spec
from megarl.models.trainable import MegatronModel


class Learner:
    def __init__(self, cfg: Config, groups: ParallelGroups, spec: ModelSpec) -> None:
        self.cfg, self.groups, self.spec = cfg, groups, spec
        te = cfg.model.transformer_engine  # auto: local layers with LoRA, whose adapters hook them
        use_te = te == "on" or (te == "auto" and transformer_engine_available() and not cfg.actor.lora_on())
        m = cfg.model
        opts = BuildOptions(dtype=DTYPES[m.dtype], vocab_pad_multiple=m.vocab_pad_multiple, transformer_engine=use_te,
                            sequence_parallel=cfg.parallel.sequence_parallel, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
                            recompute_activations=m.recompute_activations, logprob_chunk_tokens=m.logprob_chunk_tokens)
        algo, steps = cfg.algorithm, cfg.trainer.num_steps
        rollout_batch = cfg.data.num_prompts_per_step * cfg.rollout.num_samples_per_prompt
        temperature = cfg.rollout.temperature  # log-probabilities of the distribution the engine samples from
        self.actor = MegatronModel(spec, cfg.model.hf_path, groups, opts, cfg.actor.optimizer, steps,
                                   temperature=temperature, routing_replay=algo.routing_replay,
                                   updates_per_step=cfg.actor.optimizer_steps(rollout_batch),
                                   adapters=LoraAdapters(cfg.actor.lora, seed=cfg.trainer.seed)
                                   if cfg.actor.lora is not None and cfg.actor.lora_on() else None)
        self.reference: MegatronModel | BaseModel | None = None
        self.reference_files: dict[str, Any] | None = None  # a full-weight actor's reference: as teacher_files
        if algo.kl_coef > 0:  # a LoRA actor's reference is the actor with its adapters off: no second copy
            self.reference = (BaseModel(self.actor) if cfg.actor.lora_on() else
                              MegatronModel(spec, cfg.model.hf_path, groups, opts, temperature=temperature))
            if not cfg.actor.lora_on() and groups.rank == 0:  # a LoRA base has its own record (base_model.json)
                self.reference_files = manifest.weight_files(cfg.model.hf_path)
        self.teacher = None  # on-policy distillation: frozen, in the trainer's layout, at the sampling temperature
        self.teacher_files: dict[str, Any] | None = None  # its weights' record, which checkpoints keep (rank 0)
        if cfg.distill.teacher is not None:
            self.teacher = MegatronModel(load_spec(cfg.distill.teacher), cfg.distill.teacher, groups, opts,
                                         temperature=temperature)
            if groups.rank == 0:
                self.teacher_files = manifest.weight_files(cfg.distill.teacher)
        self.reward_model = None  # reward_model.path: frozen, in the trainer's layout, a scalar head
        if cfg.reward_model.path is not None:
            self.reward_model = RewardModel(load_reward_spec(cfg.reward_model.path), cfg.reward_model.path, groups,
                                            opts)
        self.critic = None
        if algo.name == "ppo":
            critic_opts = dataclasses.replace(opts, critic=True)
            critic_dir = cfg.critic.hf_path or cfg.model.hf_path
            load, start = critic_weights(critic_dir, groups, critic_opts)
            self.critic = MegatronModel(spec, critic_dir, groups, critic_opts, cfg.critic.optimizer, steps,
                                        updates_per_step=cfg.critic.optimizer_steps(rollout_batch), load=load)
            if groups.rank == 0:
                print(start, flush=True)
        if groups.rank == 0:
            print(f"megarl: {'Transformer Engine' if use_te else 'local'} layers "
                  f"({layer_implementation(self.actor.chunks)})", flush=True)
        self.kl = make_kl_controller(algo)
        self.top1: dict[str, torch.Tensor] = {}
        """Distillation: the most likely token at every position of the batch last scored, [N, T], by role."""
        self.residency: Residency | Any = None

    def place(self, actor_weights_stay: bool) -> None:
        """Decide what may leave the device (``actor_weights_stay``: the engine maps the actor's weights) and keep
        only what generation needs."""
        reference = {"reference": self.reference} if isinstance(self.reference, MegatronModel) else {}
        teacher = {"teacher": self.teacher} if self.teacher is not None else {}
        teacher |= {"reward_model": self.reward_model.model} if self.reward_model is not None else {}
        self.residency = Residency(self.trained_models() | reference | teacher,
                                   offloadable_parts(self.cfg, actor_weights_stay=actor_weights_stay))
        self.hold("generate")

    def hold(self, phase: str) -> None:
        """Keep on the device only what ``phase`` uses (megarl.memory.offload). Before the phases in which the engine
        takes memory (its weights wake for the hand-over, its KV cache for generation), what left and what the
        last phase cached go back to the driver: in torch's cache a colocated engine could not allocate them."""
        self.residency.hold(PHASE_NEEDS[phase])
        if phase in ("handover", "generate") and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # blocks the engine mapped until its detach
            torch.cuda.empty_cache()

    def hold_for_checkpoint(self, role: str) -> None:
        """Before a checkpoint reads or writes ``role``: its whole state on the device, the rest offloaded (one
        model's state at a time)."""
        self.residency.hold({"actor": {"weights"}, role: set(PARTS)})

    def trained_models(self) -> dict[str, MegatronModel]:
        """The models whose weights and optimizer state a checkpoint holds."""
        return {"actor": self.actor} | ({"critic": self.critic} if self.critic is not None else {})

    def step_metrics(self) -> dict[str, float]:
        """Since the last call: seconds spent moving state between device and host (inside the phases' times) and,
        with routing replay, the share of expert choices the actor would have made otherwise."""
        seconds, self.residency.seconds = self.residency.seconds, 0.0
        return {"offload_seconds": seconds} | self.actor.routing_disagreement()

    def score(self, batch: Batch, model: MegatronModel | BaseModel | None) -> torch.Tensor | None:
        """Logprobs (actor/reference) or values (critic) of the batch as [N, T] on every rank; each
        data-parallel replica scores its share of the sequences."""
        if model is None:
            return None
        self.hold("values" if model is self.critic else "teacher" if model is self.teacher
                  else "score" if not isinstance(model, MegatronModel) or model is self.actor else "reference")
        section = self.cfg.critic if model is self.critic else self.cfg.actor
        g = self.groups
        mine = list(range(g.dp_rank, len(batch.sequences), g.dims.dp))
        role = "actor" if model is self.actor else "teacher" if model is self.teacher else None
        top1 = self.teacher is not None and role is not None  # distillation: whose most likely token agrees
        rows = model.score([batch.sequences[i] for i in mine], *_batching(section),
                           routing=_routing(model, batch, mine), **({"top1": True} if top1 else {}))
        if rows is not None:
            _check_rows(rows, [batch.sequences[i] for i in mine], mine, role or ("critic" if model is self.critic
                                                                              else "reference"))
        if top1 and role is not None:
            self.top1[role] = self._share_rows(dict(zip(mine, [r[:, 1] for r in rows], strict=True))
                                               if rows is not None else None, batch)
            rows = None if rows is None else [r[:, 0] for r in rows]
        return self._share_rows(dict(zip(mine, rows, strict=True)) if rows is not None else None, batch)

    def reward_scores(self, sequences: list[list[int]]) -> torch.Tensor:
        """The reward model's [N] scores of ``sequences`` (its token ids) on every rank; each data-parallel replica
        scores its share, in the actor's micro-batches."""
        assert self.reward_model is not None, "reward_model.path is null"
        self.hold("reward_model")
        model = self.reward_model
        return scores_on_every_rank(lambda mine: model.score(mine, *_batching(self.cfg.actor)), sequences,
                                    self.groups)

    def top1_agreement(self, batch: Batch) -> float:
        """Distillation: the share of the batch's policy tokens at which the actor's most likely next token is the
        teacher's (both scored on this batch)."""
        same = (self.top1["actor"] == self.top1["teacher"]).float() * batch.mask
        return float(same.sum() / batch.mask.sum().clamp(min=1))

    def optimize(self, model: MegatronModel, section: UpdateConfig, batch: Batch, extras: dict[str, torch.Tensor],
                 loss: Any, where: str, step: int, mask: torch.Tensor) -> dict[str, float]:
        """``num_ppo_epochs`` passes over the batch in shuffled mini-batches of ``mini_batch_size`` samples
        (megarl.algos.minibatches), one optimizer step each (none for a mini-batch with no token in the loss). Token
        weights are normalised per mini-batch over all DP ranks, over the tokens of ``mask`` [N, T] (response tokens
        that count in the loss), so each step optimises the configured aggregation of its mini-batch; each DP rank
        trains on its share."""
        g, n, aggregation = self.groups, len(batch.sequences), self.cfg.algorithm.loss_aggregation
        steps: list[dict[str, float]] = []
        empty = 0
        for epoch in range(section.num_ppo_epochs):
            parts = mini_batches(n, section.mini_batch_size or n, self.cfg.trainer.seed, step, epoch)
            for part, index in enumerate(parts):
                if not bool(mask[index].any()):  # filler or rejected samples alone: the same on every rank
                    # No optimizer step: with a zero gradient, Adam's momentum and weight decay would still move
                    # the weights. The schedule goes on as for the step it stands for.
                    model.skip_step()
                    empty += 1
                    continue
                weights = token_weights(mask[index], aggregation, self.cfg.rollout.max_new_tokens)
                mine = list(range(g.dp_rank, len(index), g.dims.dp))
                seqs = [batch.sequences[index[j]] for j in mine]
                rows = {k: [v[index[j], : len(seqs[m]) - 1] for m, j in enumerate(mine)] for k, v in extras.items()}
                rows["weights"] = [weights[j, : len(seqs[m]) - 1] for m, j in enumerate(mine)]
                steps.append(model.train_step(seqs, rows, loss, *_batching(section),
                                              where=f"{where}, epoch {epoch}, mini-batch {part + 1} of {len(parts)}",
                                              routing=_routing(model, batch, [index[j] for j in mine])))
        return (mean_metrics(steps) if steps else {}) | ({"empty_minibatches": float(empty)} if empty else {})

    def update_actor(self, batch: Batch, extras: dict[str, torch.Tensor], step: int, mask: torch.Tensor
                     ) -> dict[str, float]:
        """Clipped policy updates; extras: old_logprobs, advantages[, ref_logprobs][, is_weights][, teacher_logprobs]
        [, offpolicy_weights] as [N, T];
        ``mask`` [N, T]: the response tokens the loss counts (rl_step.actor_loss_mask)."""
        algo, actor = self.cfg.algorithm, self.actor
        entropy_on = algo.entropy_coef > 0

        def loss(logits: torch.Tensor, tokens: torch.Tensor, ex: dict[str, torch.Tensor]) -> Any:
            logp = actor.token_logprobs(logits, tokens)
            return actor_loss(logp, ex, algo, self.kl.value, actor.token_entropy(logits) if entropy_on else None,
                              self.cfg.distill.coef)

        self.hold("actor_update")
        metrics = self.optimize(actor, self.cfg.actor, batch, extras, loss, f"step {step}, actor", step, mask)
        return {f"actor/{k}": v for k, v in metrics.items()}

    def update_critic(self, batch: Batch, extras: dict[str, torch.Tensor], step: int, mask: torch.Tensor
                      ) -> dict[str, float]:
        """Clipped value updates; extras: old_values, returns as [N, T]; ``mask`` [N, T]: the tokens the loss counts
        (rl_step.critic_loss_mask)."""
        if self.critic is None:
            return {}
        algo = self.cfg.algorithm
        self.hold("critic_update")
        metrics = self.optimize(self.critic, self.cfg.critic, batch, extras,
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
    "teacher": {"actor": {"weights"}, "teacher": {"weights"}},
    "reward_model": {"actor": {"weights"}, "reward_model": {"weights"}},
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
            "reference": weights if cfg.reference.offload_weights else set(),
            "teacher": weights if cfg.distill.offload_weights else set(),
            "reward_model": weights if cfg.reward_model.offload_weights else set()}


class ScoringFailed(UserError):
    """A model's scoring pass returned outputs that do not fit the batch it scored."""

    on_every_rank = False  # the ranks that hold the rows (each replica's last pipeline stage) see it


def _check_rows(rows: list[torch.Tensor], sequences: list[list[int]], index: list[int], role: str) -> None:
    """Every sequence's scored row has one value per predicted token (len - 1): a shorter one would be padded with
    zeros into the batch's [N, T] and trained on as logprobs (a teacher's as a reverse KL of log pi_student - 0)."""
    for i, row, seq in zip(index, rows, sequences, strict=True):
        if row.shape[0] != len(seq) - 1:
            raise ScoringFailed(f"the {role}'s scoring pass returned {row.shape[0]} values for sequence {i} of the "
                                f"batch, which predicts {len(seq) - 1} tokens ({len(seq)} tokens long). Training "
                                "stopped before the step's update; the last complete checkpoint is intact. This is "
                                "a fault in the scoring pass (its micro-batching or packing), not in the data: "
                                "report it with the run's config.yaml.")


def _routing(model: MegatronModel | BaseModel, batch: Batch, index: list[int]) -> list[Any] | None:
    """The engine's expert choices for the samples at ``index`` if ``model`` replays them (routing replay)."""
    if model.replay is None:
        return None
    assert batch.routing is not None, "routing replay without the engine's routing"
    return [batch.routing[i] for i in index]


def _batching(section: UpdateConfig) -> tuple[int | None, int]:
    """(max_tokens, micro_batch_size) for MegatronModel: a token budget, or fixed micro-batches."""
    return (section.max_tokens_per_gpu if section.dynamic_batch else None), section.micro_batch_size
