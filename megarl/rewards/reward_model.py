"""A learned reward model's part of a sample's reward (reward_model): what it reads, and how its score joins the
rule reward, r = rule_weight x rule + weight x clip(normalise(rm)).

The reward model reads the conversation as its own tokenizer renders it. With the policy's vocabulary and chat
template it reads the policy's token ids as they are; with any other it reads the prompt and the response as text,
rendered again by its tokenizer and chat template as reward-model training renders a pair (megarl.data.conversation):
a token id of one vocabulary is never read with another.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from megarl.config import Config, RewardModelConfig
from megarl.data.conversation import render_conversation
from megarl.rollout.stops import ends_in_stop


class RunningStats:
    """Mean and standard deviation of every score seen so far (Chan et al.'s parallel update of Welford's)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        values = values.double()
        n = values.numel()
        if n == 0:
            return
        mean = float(values.mean())
        m2 = float(((values - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def combine(rule: torch.Tensor, rm: torch.Tensor, cfg: RewardModelConfig, stats: RunningStats
            ) -> tuple[torch.Tensor, dict[str, float]]:
    """[N] rule rewards and [N] reward-model scores -> [N] rewards, and the step's metrics. With ``normalize`` the
    scores are standardised by ``stats`` once this step's scores are in them."""
    rm = rm.float()
    shaped = rm
    if cfg.normalize:
        stats.update(rm)
        shaped = (rm - stats.mean) / max(stats.std, 1e-6)
    if cfg.clip is not None:
        shaped = shaped.clamp(-cfg.clip, cfg.clip)
    total = cfg.rule_weight * rule.float() + cfg.weight * shaped
    metrics = {"reward_model/score_mean": float(rm.mean()), "reward_model/score_std": float(rm.std(correction=0)),
               "reward_model/shaped_mean": float(shaped.mean()), "reward_model/rule_mean": float(rule.float().mean())}
    if cfg.normalize:
        metrics |= {"reward_model/running_mean": stats.mean, "reward_model/running_std": stats.std}
    if cfg.clip is not None:
        metrics["reward_model/clipped_fraction"] = float(((shaped == cfg.clip) | (shaped == -cfg.clip)).float().mean())
    if float(rule.float().std()) > 0 and float(rm.std()) > 0:  # defined only where both vary over the batch
        # The reward model against the rule (a gold reward where the rule is the task's check): a correlation that
        # falls while the reward model's score rises is the policy over-optimising the reward model.
        metrics["reward_model/rule_correlation"] = float(torch.corrcoef(torch.stack([rm, rule.float()]))[0, 1])
    return total, metrics


def render(prompt: str, response: str, finished: bool, tokenizer: Any, cfg: Config) -> list[int]:
    """The reward model's token ids of one sample, as reward-model training renders a pair's conversation
    (megarl.data.conversation): the prompt as data.* renders it for the policy (data.system_prompt, the user turn),
    the response after data.response_prefix, and the end token only if the sample ``finished`` (a response the
    token budget cut has none, as the policy's own ids have none)."""
    d = cfg.data
    system = [{"role": "system", "content": d.system_prompt}] if d.system_prompt is not None else []
    return render_conversation([*system, {"role": "user", "content": prompt}], (d.response_prefix or "") + response,
                               tokenizer, d.apply_chat_template, finished)


def reward_inputs(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], prompts: Sequence[str] | None,
                  stop_ids: Collection[int], shares_tokens: bool, tokenizer: Any,
                  decode: Callable[[list[int]], str], cfg: Config) -> list[list[int]]:
    """What the reward model reads of each sample: the policy's ids when it shares their tokenizer, else the
    conversation rendered again (``prompts``: each sample's prompt text; the response decoded by ``decode``, the
    policy's tokenizer without special tokens). A sample finished where its last token is one of ``stop_ids``, the
    tokens generation stops at (megarl.rollout.stops)."""
    if shares_tokens:
        return [list(s) for s in sequences]
    assert prompts is not None and len(prompts) == len(sequences), "a re-rendered conversation needs its prompt"
    return [render(prompt, decode(list(seq[n:])), ends_in_stop(seq[n:], stop_ids), tokenizer, cfg)
            for seq, n, prompt in zip(sequences, prompt_lens, prompts, strict=True)]
