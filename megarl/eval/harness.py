"""Held-out evaluation: k samples per prompt from a rollout engine, scored by a reward function.

A sample is correct when its reward is positive (the bundled verifiers give 1.0 or 0.0). Per dataset:
``accuracy`` (mean reward over all samples, = ``mean@k``), ``pass@k`` (share of prompts with a correct sample
among their k), ``mean_length`` (the policy's tokens, as training's response_length), ``truncated_fraction``
(samples cut by the token budget, max_new_tokens: as training's agent/cut_by_budget with tools, where a sample
stopped by agent.max_turns is not truncated but counted in agent/cut_by_turns), and with tools the means of
``agent/turns``, ``agent/tool_calls``, ``agent/tool_errors``, ``agent/tool_timeouts``, ``agent/tool_tokens``,
``agent/cut_by_budget`` and ``agent/cut_by_turns``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.data.batching import TokenizedPrompt
from megarl.errors import UserError
from megarl.rewards.registry import RewardFn, checked_scores
from megarl.rewards.text import reads_tool_turns, reward_text
from megarl.rollout.base import Completion, SamplingParams


@dataclass(frozen=True, slots=True)
class Sample:
    prompt: str
    completion: str
    reward: float
    tokens: int
    truncated: bool


def metrics(rewards: Sequence[Sequence[float]], lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """[prompts][k] rewards and per-sample lengths and truncation -> the dataset's metrics (see module doc)."""
    k = len(rewards[0])
    flat = [r for group in rewards for r in group]
    out = {"accuracy": sum(flat) / len(flat), "num_prompts": float(len(rewards)),
           "mean_length": sum(lengths) / len(lengths), "truncated_fraction": sum(truncated) / len(truncated)}
    if k > 1:
        out[f"pass@{k}"] = sum(any(r > 0 for r in group) for group in rewards) / len(rewards)
        out[f"mean@{k}"] = out["accuracy"]
    return out


def score(prompts: Sequence[TokenizedPrompt], completions: Sequence[Completion], reward_fn: RewardFn, k: int,
          decode: Callable[[list[int]], str]) -> tuple[dict[str, float], list[Sample]]:
    """``k`` completions per prompt, grouped in prompt order, scored: (metrics, samples in that order)."""
    texts = [decode(c.token_ids) for c in completions]
    tool_turns = reads_tool_turns(reward_fn)
    scores = reward_fn([reward_text(decode, c.token_ids, c.policy_mask, tool_turns) for c in completions],
                       [prompts[c.prompt_index].record.answer for c in completions])
    rewards = checked_scores(scores, len(completions), getattr(reward_fn, "where", "the reward function"))
    samples = [Sample(prompt=prompts[c.prompt_index].record.prompt, completion=text, reward=reward,
                      tokens=len(c.token_ids) if c.policy_mask is None else sum(c.policy_mask),
                      truncated=c.finish_reason == "length" if c.stats is None else c.stats["cut_by_budget"] > 0)
               for c, text, reward in zip(completions, texts, rewards, strict=True)]
    grouped = [rewards[i * k:(i + 1) * k] for i in range(len(prompts))]
    out = metrics(grouped, [s.tokens for s in samples], [s.truncated for s in samples])
    if completions and completions[0].stats:  # multi-turn: how the tools were used
        out |= {f"agent/{key}": sum((c.stats or {})[key] for c in completions) / len(completions)
                for key in ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_sandbox_failures",
                            "tool_tokens", "cut_by_budget", "cut_by_turns")}
    return out, samples


def evaluate(generate: Callable[[list[list[int]], SamplingParams], list[Completion]],
             prompts: Sequence[TokenizedPrompt], reward_fn: RewardFn, params: SamplingParams,
             decode: Callable[[list[int]], str]) -> tuple[dict[str, float], list[Sample]]:
    """Generate ``params.n`` samples per prompt (``generate``: an engine's, or the trainer's over all its engines)
    and score them: (metrics with seconds, samples in prompt order)."""
    start = time.perf_counter()
    out, samples = score(prompts, generate([p.tokens for p in prompts], params), reward_fn, params.n, decode)
    return out | {"seconds": time.perf_counter() - start}, samples


def write_samples(path: Path, samples: Sequence[Sample], fix: str) -> None:
    """One JSON object per sample (prompt, completion, reward, tokens, truncated): ``write_jsonl``."""

    def rows() -> Iterator[dict[str, Any]]:  # read as they are written, inside write_jsonl's handling of errors
        for s in samples:
            yield {"prompt": s.prompt, "completion": s.completion, "reward": s.reward, "tokens": s.tokens,
                   "truncated": s.truncated}

    write_jsonl(path, rows(), "the evaluation's samples", fix)


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]], what: str, fix: str) -> None:
    """One JSON object per line, written atomically; a write that fails (a full disk) removes its partial file and
    is one paragraph naming ``what`` was written and ending in ``fix``."""
    partial = path.with_name(path.name + ".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        partial.replace(path)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise UserError(f"writing {what} to {path} failed ({err.strerror or err}); the partial "
                        f"file is removed. Fix: {fix}") from None
