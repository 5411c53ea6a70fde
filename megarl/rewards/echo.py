"""Reward of the tiny "echo" task (recipes/tiny): 1.0 when the response's first word is the answer."""

from __future__ import annotations


def reward(completions: list[str], answers: list[str]) -> list[float]:
    return [1.0 if (text.split() or [""])[0] == answer.strip() else 0.0
            for text, answer in zip(completions, answers, strict=True)]
