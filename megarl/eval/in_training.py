"""Held-out evaluation during training (the ``eval`` config section), on the colocated engines.

Each evaluation runs right after a hand-over, so the engines already hold the weights it measures: no
extra hand-over and no second copy. Every engine generates its share of the prompts. The weights after
step N are evaluated when eval.every divides N + 1, and after the last step; their metrics
(``eval/<name>/accuracy``, ``pass@k``, ``mean@k``, ``mean_length``, ``truncated_fraction``, ``seconds``)
go into step N's row. eval.before_train evaluates the starting weights too, under
``eval/<name>/initial/...`` in step 0's row. Samples go to ``eval/<name>/step_N.jsonl`` (``initial.jsonl``)
in the run directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.checkpoint.keep_best import mark_best
from megarl.checkpoint.paths import rotate
from megarl.config import Config, EvalDatasetConfig
from megarl.data.batching import TokenizedPrompt, tokenize_prompts
from megarl.data.prompts import load_prompts
from megarl.eval.harness import evaluate, write_samples
from megarl.rewards.registry import RewardFn, load_reward
from megarl.rollout.base import SamplingParams


@dataclass(frozen=True, slots=True)
class EvalSet:
    name: str
    prompts: list[TokenizedPrompt]
    reward_fn: RewardFn
    params: SamplingParams


def load_eval_sets(cfg: Config, tokenizer: Any, stop_token_ids: tuple[int, ...]) -> list[EvalSet]:
    """Every eval dataset read, templated, tokenized and its reward imported: bad input fails at start-up."""
    sets = []
    for i, d in enumerate(cfg.eval.datasets):
        sets.append(_load(cfg, d, f"eval.datasets[{i}]", tokenizer, stop_token_ids))
    return sets


def _load(cfg: Config, d: EvalDatasetConfig, where: str, tokenizer: Any, stop: tuple[int, ...]) -> EvalSet:
    data, e = cfg.data, cfg.eval
    template = d.prompt_template if d.prompt_template is not None else data.prompt_template
    records = load_prompts(d.path, d.prompt_key or data.prompt_key, d.answer_key or data.answer_key, template,
                           f"{where}.path")[:d.max_prompts]
    prompts, _ = tokenize_prompts(records, tokenizer, data.apply_chat_template, cfg.rollout.max_prompt_tokens,
                                  source=repr(d.path), system_prompt=_own(d.system_prompt, data.system_prompt),
                                  response_prefix=_own(d.response_prefix, data.response_prefix), field=f"{where}.path")
    reward_fn = load_reward(d.reward or str(cfg.trainer.reward), f"{where}.reward")  # one is set (Config)
    params = SamplingParams(n=d.num_samples or e.num_samples,
                            temperature=e.temperature if d.temperature is None else d.temperature,
                            max_new_tokens=d.max_new_tokens or e.max_new_tokens or cfg.rollout.max_new_tokens,
                            stop_token_ids=stop, seed=cfg.rollout.seed)
    return EvalSet(d.name, prompts, reward_fn, params)


def _own(value: str | None, inherited: str | None) -> str | None:
    """An eval set's own text ("": none for this set), else the training data's."""
    return inherited if value is None else value or None


class InTrainingEval:
    """Runs the eval sets on a trainer's engines when due; rank 0 writes the samples."""

    def __init__(self, cfg: Config, sets: list[EvalSet], out_dir: Path, rank: int) -> None:
        self.every, self.num_steps, self.sets = cfg.eval.every, cfg.trainer.num_steps, sets
        self.before_train = cfg.eval.before_train and bool(sets)
        self.out_dir, self.rank = out_dir, rank
        self.best_metric, self.keep_last = cfg.checkpoint.keep_best, cfg.checkpoint.keep_last
        self.saves, self.save_every = cfg.checkpoint.dir is not None, cfg.checkpoint.save_every

    def due(self, step: int) -> bool:
        """Whether the weights after ``step`` are evaluated."""
        return bool(self.sets) and ((self.every > 0 and (step + 1) % self.every == 0) or step + 1 == self.num_steps)

    def keep_best(self, step: int, metrics: dict[str, float], saved: bool) -> None:
        """checkpoint.keep_best: step's checkpoint, when this run ``saved`` it and it scored best so far
        (megarl.checkpoint.keep_best). A step it did not save may still have a step_N of a branch a resume from an
        earlier checkpoint left: not these weights."""
        if self.best_metric is not None and self.rank == 0 and saved and mark_best(self.out_dir, self.best_metric,
                                                                                   step, metrics):
            print(f"megarl: step {step}'s checkpoint is the best so far on {self.best_metric} "
                  f"({metrics[self.best_metric]:.4f}); it stays outside checkpoint.keep_last", flush=True)
            # The best before it was kept only as the best: outside keep_last, it goes now, not at the next save
            # (after the last step there is none, and it stayed for good).
            rotate(self.out_dir, self.keep_last, self.out_dir / f"step_{step:06d}")

    def run(self, trainer: Any, decode: Any, label: str) -> dict[str, float]:
        """Evaluate the weights the engines hold now; ``label``: "initial" or "step_N" (the samples' file)."""
        out: dict[str, float] = {}
        prefix = "initial/" if label == "initial" else ""
        for s in self.sets:
            row, samples = evaluate(trainer.generate_all, s.prompts, s.reward_fn, s.params, decode)
            out |= {f"eval/{s.name}/{prefix}{key}": value for key, value in row.items() if key != "num_prompts"}
            if self.rank == 0:
                write_samples(self.out_dir / "eval" / s.name / f"{label}.jsonl", samples, self._after_full_disk(label))
        return out

    def _after_full_disk(self, label: str) -> str:
        """How a run whose samples filled the disk goes on: from the checkpoint saved just before this evaluation
        (`latest` names it), else from an earlier one or anew; no message may promise a checkpoint not there."""
        free = "free space on the run directory's disk (df -h) and"
        if label == "initial":
            return f"{free} run again: this evaluation of the starting weights comes before the first step."
        latest = self.out_dir / "latest"
        last = latest.read_text().strip() if self.saves and latest.is_file() else None
        if last == f"step_{int(label.removeprefix('step_')):06d}":
            return f"{free} resume the run: the checkpoint of this step is saved, and its evaluation runs again."
        unsaved = f"no checkpoint of this step was saved (checkpoint.save_every = {self.save_every})"
        if last is None:
            return f"{free} run again: {unsaved} nor of any before it, so the run starts anew."
        return (f"{free} resume the run: {unsaved}, so it resumes from {last}, the last one, and trains the steps "
                "after it again.")
