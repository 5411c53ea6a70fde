"""The reward model's phase of a step (reward_model.path): after generation, before advantages, its score of every
sample joins the rule reward in ``batch.scores`` (megarl.rewards.reward_model.combine)."""

from __future__ import annotations

from typing import Any

from megarl.checkpoint import manifest
from megarl.config import Config
from megarl.data.tokenizer import decoder
from megarl.errors import UserError
from megarl.loop.learner import Learner
from megarl.loop.rl_step import Batch
from megarl.loop.step_prompts import StepPrompts
from megarl.models.reward_model import check_reward_model
from megarl.models.spec import ModelSpec
from megarl.rewards.reward_model import RunningStats, combine, reward_inputs


class RewardModelPhase:
    def __init__(self, cfg: Config, learner: Learner, tokenizer: Any, spec: ModelSpec, stop_ids: tuple[int, ...]
                 ) -> None:
        """``stop_ids``: the tokens generation stops at; a sample ending in one finished, and a conversation
        rendered again ends in the reward model's end token only then."""
        assert cfg.reward_model.path is not None and learner.reward_model is not None
        self.cfg, self.learner, self.stop_ids = cfg, learner, stop_ids
        found = check_reward_model(cfg.reward_model.path, cfg.model.hf_path, tokenizer, spec)
        self.shares_tokens, self.tokenizer = found.shares_tokens, found.tokenizer
        self.context = found.spec.max_position_embeddings
        self.decode = decoder(tokenizer)
        self.stats = RunningStats()
        """reward_model.normalize: every score so far (a checkpoint keeps them)."""
        self.files = manifest.weight_files(cfg.reward_model.path) if learner.groups.rank == 0 else None
        """Its weight files (path, sizes, CRC-32s), which checkpoints keep (rank 0): a resume must find them."""
        self.step_prompts = StepPrompts("reward_model", "the reward model cannot render their conversations again")

    def __call__(self, batch: Batch) -> dict[str, float]:
        """Score the batch, and put rule_weight x rule + weight x rm into ``batch.scores``; the step's metrics."""
        texts = None
        if not self.shares_tokens:
            n = self.cfg.rollout.num_samples_per_prompt
            texts = [record.prompt for record in self.step_prompts.records(batch.sequences, batch.prompt_lens, n)]
        inputs = reward_inputs(batch.sequences, batch.prompt_lens, texts, self.stop_ids, self.shares_tokens,
                               self.tokenizer, self.decode, self.cfg)
        actor = self.cfg.actor
        longest = max(len(s) for s in inputs)
        if actor.dynamic_batch and longest > actor.max_tokens_per_gpu:  # a conversation rendered again can be longer
            raise UserError(f"reward_model.path = {self.cfg.reward_model.path!r}: a conversation rendered with its "
                            f"tokenizer and chat template has {longest} tokens, more than actor.max_tokens_per_gpu = "
                            f"{actor.max_tokens_per_gpu}, the micro-batches it scores in. Fix: raise "
                            f"actor.max_tokens_per_gpu to at least {longest}.")
        if longest > self.context:  # start-up bounds the policy's tokens; another tokenizer's count can be higher
            raise UserError(f"reward_model.path = {self.cfg.reward_model.path!r}: a conversation rendered with its "
                            f"tokenizer and chat template has {longest} tokens, past its context "
                            f"(max_position_embeddings = {self.context}); its score would be out of what it was "
                            "trained on. Fix: lower rollout.max_new_tokens or max_prompt_tokens, or use a reward model "
                            "with a longer context.")
        scores = self.learner.reward_scores(inputs)
        batch.rewards = batch.rewards | {"rule": batch.scores.clone(), "reward_model": scores}
        batch.scores, metrics = combine(batch.scores, scores, self.cfg.reward_model, self.stats)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: normalize's statistics, and the weight files (resume_check compares them)."""
        return {"statistics": self.stats.state_dict(), "files": self.files}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.stats.load_state_dict(state["statistics"])
