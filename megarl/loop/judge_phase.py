"""An LLM judge's phase of a step (reward_model.judge), in place of a reward model's (megarl.loop.reward_phase):
after generation, before advantages, rank 0's judge engine is asked about every sample, and each verdict's parsed
score joins the rule reward in ``batch.scores`` (megarl.rewards.reward_model.combine).

The judge is one engine of rollout.engine's kind, started and driven by rank 0 (its first judge.tensor_parallel
GPUs), colocated: it sleeps outside its phase where the engine has a sleep mode. vLLM's CPU backend has none, so on
CPU the judge keeps its memory between phases, which start-up says in one line.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megarl.config import Config, run_dir
from megarl.data.tokenizer import decoder, load_tokenizer
from megarl.errors import UserError
from megarl.loop.rl_step import Batch
from megarl.loop.step_prompts import StepPrompts
from megarl.rewards.judge import judge_text, load_parse, parse_verdicts, render
from megarl.rewards.reward_model import RunningStats, combine
from megarl.rollout.base import SamplingParams
from megarl.rollout.stops import sample_stop_ids


class JudgePhase:
    shares_tokens = False
    """The judge reads each sample as text (trainer.generate then keeps the step's prompts)."""
    files = None
    """No weight files for a resume to compare (the judge is named by reward_model.judge, which defines the run)."""

    def __init__(self, cfg: Config, rank: int, world: int, tokenizer: Any) -> None:
        assert cfg.reward_model.judge is not None
        self.cfg, self.judge, self.rank, self.world = cfg, cfg.reward_model.judge, rank, world
        self.decode = decoder(tokenizer)
        self.parse = load_parse(self.judge.parse)
        self.stats = RunningStats()
        """reward_model.normalize: every score so far (a checkpoint keeps them)."""
        self.step_prompts = StepPrompts("reward_model.judge", "the judge cannot read their text")
        self.engine: Any = None
        self.tokenizer: Any = None
        self.steps = 0
        self._host_group = None if dist.get_backend() == "gloo" else \
            dist.new_group(backend="gloo", timeout=cfg.host_group_timeout())

    def start(self) -> None:
        """Rank 0 starts the judge's engine and puts it to sleep until its first phase."""
        if self.rank != 0:
            return
        from megarl.rollout.factory import engine_class

        j, cfg = self.judge, self.cfg
        self.tokenizer = load_tokenizer(j.model, "reward_model.judge.model")
        self.stop_ids = sample_stop_ids(self.tokenizer.eos_token_id, j.model)
        log_file = run_dir(cfg) / "judge_engine.log"
        print(f"megarl: starting the judge's {cfg.rollout.engine} engine ({j.model}, tensor_parallel "
              f"{j.tensor_parallel}); its output goes to {log_file}", flush=True)
        self.engine = engine_class(cfg)(j.model, tensor_parallel=j.tensor_parallel,
                                        gpu_memory_fraction=j.gpu_memory_fraction,
                                        max_model_len=j.max_prompt_tokens + j.max_new_tokens, seed=j.seed,
                                        log_file=log_file)
        if not self.engine.releases_memory:
            print("megarl: reward_model.judge: the engine has no sleep mode here (vLLM on CPU), so the judge keeps "
                  f"its memory (gpu_memory_fraction {j.gpu_memory_fraction} of host RAM) between its phases",
                  flush=True)
        self.engine.sleep()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _ask(self, batch: Batch) -> tuple[list[float], list[bool], list[bool]] | str:
        """Rank 0: every sample's score, whether its verdict was unparsable, whether it was not asked (its prompt
        empty or too long); or the error that stops the run, as text for every rank."""
        j, n = self.judge, self.cfg.rollout.num_samples_per_prompt
        try:
            records = self.step_prompts.records(batch.sequences, batch.prompt_lens, n)
        except UserError as err:
            return str(err)
        asks: list[list[int]] = []
        for seq, length, record in zip(batch.sequences, batch.prompt_lens, records, strict=True):
            text = judge_text(j.prompt_template, record.prompt, self.decode(list(seq[length:])), record.answer)
            asks.append(render(text, self.tokenizer, j.apply_chat_template))
        sent = [i for i, ids in enumerate(asks) if 0 < len(ids) <= j.max_prompt_tokens]
        verdicts = [""] * len(asks)
        if sent:
            params = SamplingParams(temperature=j.temperature, max_new_tokens=j.max_new_tokens,
                                    stop_token_ids=self.stop_ids, seed=j.seed + self.steps * 100003)
            self.engine.wake()
            try:
                done = self.engine.generate([asks[i] for i in sent], params)
            finally:
                self.engine.sleep()
            for c in done:
                verdicts[sent[c.prompt_index]] = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        try:
            scores, unparsable = parse_verdicts(verdicts, self.parse, j.parse, j.unparsable_score)
        except UserError as err:
            return str(err)
        unsent = [True] * len(asks)
        for i in sent:
            unsent[i] = False
        for i in range(len(asks)):
            if unsent[i]:
                scores[i], unparsable[i] = j.unparsable_score, False
        return scores, unparsable, unsent

    def __call__(self, batch: Batch) -> dict[str, float]:
        """Ask the judge about the batch, and put rule_weight x rule + weight x judge into ``batch.scores``; the
        step's metrics."""
        answer = self._ask(batch) if self.rank == 0 else None
        if self.world > 1:
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, answer, group=self._host_group)
            answer = parts[0]
        self.steps += 1
        if isinstance(answer, str):
            raise UserError(answer)
        assert answer is not None
        values, unparsable, unsent = answer
        scores = torch.tensor(values, dtype=torch.float32)
        batch.rewards = batch.rewards | {"rule": batch.scores.clone(), "judge": scores}
        batch.scores, metrics = combine(batch.scores, scores, self.cfg.reward_model, self.stats)
        count = max(1, len(values))
        return metrics | {"reward_model/judge_score_mean": float(scores.mean()),
                          "reward_model/judge_unparsable_fraction": sum(unparsable) / count,
                          "reward_model/judge_unsent_fraction": sum(unsent) / count}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: normalize's statistics."""
        return {"statistics": self.stats.state_dict(), "files": None}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.stats.load_state_dict(state["statistics"])
