"""The text a rule reward reads of a sample (trainer.reward in training, the reward of an evaluation): what the
policy wrote. A multi-turn sample's tool turns are left out unless the reward function asks for them with a
``reads_tool_turns = True`` attribute (a verifier that checks what a tool returned): a reward that falls back to a
response's last number would otherwise take a tool's output for the model's answer, and pay a sample that called
the tool and never answered."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def reads_tool_turns(reward: Any) -> bool:
    """Whether ``reward`` (a function, or a scorer that carries its attribute) reads the tool turns too."""
    return bool(getattr(reward, "reads_tool_turns", False))


def reward_text(decode: Callable[[list[int]], str], tokens: Sequence[int], policy_mask: Sequence[int] | None,
                tool_turns: bool) -> str:
    """``tokens`` as a reward reads them: all of them with ``tool_turns`` or no mask, else each run of the policy's
    tokens decoded on its own and the runs joined by newlines, so that no two of them run into one word or number."""
    if policy_mask is None or tool_turns:
        return decode(list(tokens))
    runs: list[list[int]] = [[]]
    for token, mine in zip(tokens, policy_mask, strict=True):
        if mine:
            runs[-1].append(token)
        elif runs[-1]:
            runs.append([])
    return "\n".join(decode(run) for run in runs if run)
