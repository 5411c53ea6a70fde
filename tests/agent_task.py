"""A task only a tool call solves, for the tiny CPU recipe (tests/test_train_recipe.py): the tool draws a random
digit, and a response scores when the policy's token right after the tool turn repeats it. Its tokenizer encodes
only digits, "=" and "<eos>", so "=" closes a call and the tool turn is the digit itself."""

from __future__ import annotations

import random
import re


class Draw:
    """Draws from the seed of the sample's turn (ToolPool.run), so that a seeded run is reproducible whatever the
    timing and the number of tool workers; unseeded, from its own generator."""

    name = "draw"
    description = "a random digit"

    def __init__(self) -> None:
        self.rng = random.Random()

    def run(self, call: str, seed: int | None = None) -> str:
        return str((self.rng if seed is None else random.Random(seed)).randrange(10))


def reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the first "=" (a call) is followed by the drawn digit and then the same digit again."""
    scores = []
    for text in completions:
        drawn = re.search(r"=(\d)", text)
        scores.append(1.0 if drawn and text[drawn.end(): drawn.end() + 1] == drawn.group(1) else 0.0)
    return scores


reward.reads_tool_turns = True  # type: ignore[attr-defined]  # it checks the drawn digit, which only the tool turn shows
