"""trainer.log_samples: a step's samples as a user reads them, one JSON line each in RUN/samples/step_N.jsonl."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from megarl.config import Config
from megarl.eval.harness import write_jsonl
from megarl.loop.rl_step import Batch, shaped_scores


def due(cfg: Config, step: int) -> bool:
    """Whether step ``step`` (0-based) writes its samples: every trainer.log_samples steps, from the first."""
    every = cfg.trainer.log_samples
    return every > 0 and step % every == 0


def rows(cfg: Config, batch: Batch, decode: Callable[[list[int]], str], advantages: torch.Tensor
         ) -> Iterator[dict[str, Any]]:
    """Per sample: its group, the prompt and response as text (tool output included, as the policy saw it), the
    response's tokens, each reward (the task's, DAPO's overlong penalty when on, and with a reward model the rule's
    and the model's parts as reward/rule and reward/reward_model), the multi-turn statistics,
    and its advantage: the mean over its response tokens of ``advantages`` [N, T] (one value per sample in GRPO)."""
    shaped = shaped_scores(batch, cfg.algorithm, cfg.response_budget())
    tokens = batch.mask.sum(dim=1)
    advantage = (advantages * batch.mask).sum(dim=1) / tokens.clamp(min=1)
    group = cfg.rollout.num_samples_per_prompt
    for i, (seq, p) in enumerate(zip(batch.sequences, batch.prompt_lens, strict=True)):
        row: dict[str, Any] = {"index": i, "group": i // group, "prompt": decode(seq[:p]),
                               "response": decode(seq[p:]), "response_tokens": int(tokens[i]),
                               "reward": float(batch.scores[i])}
        if cfg.algorithm.overlong_buffer_tokens:
            row["overlong_penalty"] = float(shaped[i] - batch.scores[i])
        row |= {f"reward/{name}": float(values[i]) for name, values in batch.rewards.items()}  # reward_model
        row |= {f"agent/{name}": float(values[i]) for name, values in batch.stats.items()}
        if batch.current is not None:  # async_rl: the share of its tokens the weights being trained sampled
            row["current_policy_fraction"] = float((batch.current[i] * batch.mask[i]).sum() / tokens[i].clamp(min=1))
        row["advantage"] = float(advantage[i])
        row["trained"] = bool(batch.informative[i])
        yield row


def write(cfg: Config, out_dir: Path, rank: int, step: int, batch: Batch, decode: Callable[[list[int]], str],
          advantages: torch.Tensor) -> None:
    """Rank 0 writes step ``step``'s samples when due (every rank holds the whole batch); atomically, so a resumed
    step rewrites its file whole."""
    if rank != 0 or not due(cfg, step):
        return
    write_jsonl(out_dir / "samples" / f"step_{step}.jsonl", rows(cfg, batch, decode, advantages),
                f"step {step}'s samples (trainer.log_samples)",
                "free space on the run directory's disk (df -h) and resume the run (checkpoint.resume: auto), or set "
                "trainer.log_samples: 0.")
