"""One colocated RL step's three parts, composed: the rollout side (megarl.loop.rollout_manager), the learner
(megarl.loop.learner) and the weight sync between them (megarl.loop.weight_sync). train.py drives them through
this class, one phase at a time.

World layout: the trainer mesh (TP x PP x DP) and, colocated on the same GPUs, world / R engines
of R = ``rollout.tensor_parallel`` GPUs each (megarl.rollout.group): each engine's first rank drives
it and generates for the engine's share of the prompts, every rank hands its own engine rank's
weights over, and all ranks then see the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from megarl.config import Config
from megarl.data.batching import TokenizedPrompt
from megarl.distributed.parallel import ParallelGroups
from megarl.loop.judge_phase import JudgePhase
from megarl.loop.learner import Learner
from megarl.loop.reward_phase import RewardModelPhase
from megarl.loop.rl_step import Batch
from megarl.loop.rollout_manager import RolloutManager
from megarl.loop.timing import PartTimes
from megarl.loop.weight_sync import WeightSync
from megarl.lora.training import BaseModel
from megarl.models.attention import compile_document_attention
from megarl.models.spec import load_spec
from megarl.models.trainable import MegatronModel
from megarl.rollout.base import Completion, SamplingParams
from megarl.rollout.factory import engine_class


class RLTrainer:
    def __init__(self, cfg: Config, groups: ParallelGroups, stop_ids: tuple[int, ...] = (), tokenizer: Any = None):
        self.cfg, self.groups, self.times = cfg, groups, PartTimes()
        self.rollout = RolloutManager(cfg, groups, stop_ids, tokenizer, self.times)  # tools and reward load first
        spec = load_spec(cfg.model.hf_path)
        self.learner = Learner(cfg, groups, spec)
        self.reward_model: RewardModelPhase | JudgePhase | None = \
            RewardModelPhase(cfg, self.learner, tokenizer, spec, self.rollout.stop_ids) if cfg.reward_model.path \
            else None
        if cfg.reward_model.judge is not None:  # an LLM judge in an engine of its own (rank 0's)
            self.reward_model = JudgePhase(cfg, groups.rank, groups.dims.world_size, tokenizer)
        self.sync = WeightSync(cfg, groups, spec, self.times)
        self.learner.place(actor_weights_stay=bool(self.sync.aliased))  # the engine sizes itself next to it
        self.sync.describe()
        group, kind = self.sync.engine_group(), engine_class(cfg)
        alias_file = self.sync.share_aliases(self.learner, group, kind)
        # The first step's FlexAttention compilation, done while the engine starts (it waits on its processes).
        pool = ThreadPoolExecutor(1, thread_name_prefix="megarl-compile")
        compiled = pool.submit(compile_document_attention, self.learner.actor.chunks)
        try:
            self.rollout.start(group, kind, alias_file)
        finally:
            pool.shutdown(wait=False)
        if (seconds := compiled.result()) and groups.rank == 0:
            print(f"megarl: attention kernels compiled in {seconds:.1f} s beside the engine's start", flush=True)
        if alias_file is not None:
            alias_file.unlink()  # the engine's loader read it at start; its IPC handles mean nothing to anyone else
        self.sync.connect(self.learner, self.rollout)
        if isinstance(self.reward_model, JudgePhase):
            self.reward_model.start()  # beside the rollout engine, which has sized itself; asleep until its phase
        self.times.take()  # steps report their own hand-overs, not the first one's start-up

    @property
    def actor(self) -> MegatronModel:
        return self.learner.actor

    @property
    def reference(self) -> MegatronModel | BaseModel | None:
        return self.learner.reference

    @property
    def critic(self) -> MegatronModel | None:
        return self.learner.critic

    @property
    def teacher(self) -> MegatronModel | None:
        return self.learner.teacher

    @property
    def teacher_files(self) -> dict[str, Any] | None:
        """The distillation teacher's weight files (path, sizes, CRC-32s), which a resume must find unchanged."""
        return self.learner.teacher_files

    @property
    def reference_files(self) -> dict[str, Any] | None:
        """The KL reference's weight files (model.hf_path's, for a full-weight actor), which a resume must find
        unchanged."""
        return self.learner.reference_files

    @property
    def kl(self) -> Any:
        return self.learner.kl

    def close(self) -> None:
        self.rollout.close()
        if isinstance(self.reward_model, JudgePhase):
            self.reward_model.close()

    def sleep_engine(self) -> None:
        self.rollout.sleep()

    def generate(self, next_prompts: Callable[[], list[TokenizedPrompt]], step: int) -> tuple[Batch, dict[str, float]]:
        if self.reward_model is not None and not self.reward_model.shares_tokens:  # (sync only: bootstrap)
            next_prompts = self.reward_model.step_prompts.remembering(next_prompts)
        return self.rollout.generate(next_prompts, step)

    def score_rewards(self, batch: Batch) -> dict[str, float]:
        """reward_model.path or judge: its score joins the rule reward in ``batch.scores``; its metrics."""
        return self.reward_model(batch) if self.reward_model is not None else {}

    def generate_all(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.rollout.generate_all(prompts, params)

    def score(self, batch: Batch, model: MegatronModel | BaseModel | None) -> torch.Tensor | None:
        return self.learner.score(batch, model)

    def top1_agreement(self, batch: Batch) -> float:
        return self.learner.top1_agreement(batch)

    def update_actor(self, batch: Batch, extras: dict[str, torch.Tensor], step: int, mask: torch.Tensor
                     ) -> dict[str, float]:
        return self.learner.update_actor(batch, extras, step, mask)

    def update_critic(self, batch: Batch, extras: dict[str, torch.Tensor], step: int, mask: torch.Tensor
                      ) -> dict[str, float]:
        return self.learner.update_critic(batch, extras, step, mask)

    def push_weights(self) -> None:
        with self.rollout.pushing():
            self.sync.push(self.learner, self.rollout)

    def trained_models(self) -> dict[str, MegatronModel]:
        return self.learner.trained_models()

    def hold_for_checkpoint(self, role: str) -> None:
        """Before a checkpoint reads or writes ``role`` (the engine asleep): its whole state on the device."""
        assert self.rollout.state == "asleep" or self.rollout.separate, \
            "checkpoints are written and read while the engine sleeps (async_rl separate: it never does)"
        self.learner.hold_for_checkpoint(role)

    def step_metrics(self) -> dict[str, float]:
        """Since the last call: the learner's offload seconds (and routing replay's disagreement), the hand-over's
        parts (``handover/*_s``, inside time/reshard) and the rollout's (``rollout/*_s``: engine, reward, sleep;
        inside time/generate)."""
        return self.learner.step_metrics() | self.times.take()
