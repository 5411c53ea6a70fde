"""A reward model in training: a critic-shaped Megatron GPT (a scalar head in place of the LM head) in the trainer's
TP/PP/DP layout, trained by Bradley-Terry on preference pairs.

A step scores both conversations of every pair (each data-parallel replica its share), then trains each
conversation's score alone with the Bradley-Terry gradient's weight (megarl.algos.preference.surrogate_weights):
pairs need not share a micro-batch, a pipeline stage or a replica, and packing works as for any other model. The
score is read where transformers' sequence classification reads it: the last token that is not the pad token."""

from __future__ import annotations

import math
from typing import Any

import torch

from megarl.algos.preference import bradley_terry, surrogate_weights
from megarl.config.reward_training import RewardTrainingConfig
from megarl.distributed.parallel import ParallelGroups
from megarl.models.gpt import DTYPES, BuildOptions, load_hf_weights, transformer_engine_available
from megarl.models.reward_model import (
    last_position,
    load_reward_weights,
    pad_token_id,
    score_sequences,
    scores_on_every_rank,
)
from megarl.models.spec import ModelSpec
from megarl.models.trainable import MegatronModel
from megarl.rm.pairs import TokenizedPair


def build_options(cfg: RewardTrainingConfig) -> BuildOptions:
    m = cfg.model
    te = m.transformer_engine == "on" or (m.transformer_engine == "auto" and transformer_engine_available())
    return BuildOptions(dtype=DTYPES[m.dtype], vocab_pad_multiple=m.vocab_pad_multiple, transformer_engine=te,
                        sequence_parallel=cfg.parallel.sequence_parallel, recompute_activations=m.recompute_activations,
                        critic=True)


class RewardTrainer:
    def __init__(self, cfg: RewardTrainingConfig, groups: ParallelGroups, spec: ModelSpec, from_reward_model: bool
                 ) -> None:
        """``from_reward_model``: model.hf_path is a reward model (its body and head); else a causal LM, whose
        body starts the model under a new head drawn from N(0, initializer_range^2) at trainer.seed."""
        self.cfg, self.groups, self.spec = cfg, groups, spec
        opts = build_options(cfg)
        path = cfg.model.hf_path

        def load(chunks: list[torch.nn.Module]) -> None:
            if from_reward_model:
                load_reward_weights(chunks, spec, path, groups, opts, "model.hf_path")
                return
            load_hf_weights(chunks, spec, path, groups, opts)
            if groups.is_last_stage:  # the same head on every TP and DP rank: one seeded draw
                head: Any = chunks[-1].output_layer
                std = float(spec.hf_config.get("initializer_range", 0.02))
                gen = torch.Generator().manual_seed(cfg.trainer.seed)
                with torch.no_grad():
                    head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)

        self.model = MegatronModel(spec, path, groups, opts, cfg.training.optimizer, cfg.trainer.num_steps,
                                   load=load)
        self.pad = pad_token_id(spec)
        t = cfg.training
        self.batching = (t.max_tokens_per_gpu if t.dynamic_batch else None), t.micro_batch_size

    def scores(self, sequences: list[list[int]]) -> torch.Tensor:
        """[N] scores of ``sequences`` on every rank."""
        return scores_on_every_rank(
            lambda mine: score_sequences(self.model, self.groups, mine, self.pad, *self.batching), sequences,
            self.groups)

    def evaluate(self, pairs: list[TokenizedPair]) -> dict[str, float]:
        """Pairwise accuracy, margin, loss and mean scores over ``pairs``."""
        scores = self.scores([p.chosen for p in pairs] + [p.rejected for p in pairs])
        loss, stats = bradley_terry(scores[:len(pairs)], scores[len(pairs):])
        return {"loss": float(loss), **stats}

    def step(self, pairs: list[TokenizedPair], step: int) -> dict[str, float]:
        """One optimizer step on ``pairs`` (the whole batch, every rank the same); the pairs' statistics before it
        and the update's gradient norm and learning rate."""
        n = len(pairs)
        sequences = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        scores = self.scores(sequences)
        loss, stats = bradley_terry(scores[:n], scores[n:])
        w_chosen, w_rejected = surrogate_weights(scores[:n], scores[n:])
        weights = torch.cat([w_chosen, w_rejected]) / n  # the mean over pairs
        g = self.groups
        mine = list(range(g.dp_rank, len(sequences), g.dims.dp))
        # One token more than scored: the value read at the last scored token is then inside the [len - 1] rows of
        # per-position weights that training aligns with the model's outputs (causal: the extra token changes
        # nothing before it).
        inputs = [sequences[i] + [0] for i in mine]
        rows = []
        for i in mine:
            row = torch.zeros(len(sequences[i]))
            row[last_position(sequences[i], self.pad)] = weights[i]
            rows.append(row)

        def loss_fn(out: torch.Tensor, tokens: torch.Tensor, ex: dict[str, torch.Tensor]) -> Any:
            return (out[:, :-1, 0].float() * ex["w"]).sum(), {}

        trained = self.model.train_step(inputs, {"w": rows}, loss_fn, *self.batching, where=f"step {step}")
        out = {"loss": float(loss), **stats, "grad_norm": trained["grad_norm"], "lr": trained["lr"]}
        if not math.isfinite(out["loss"]):
            out["loss"] = float("inf")
        return out
