"""Reward functions `fn(completions, answers) -> scores` and their lookup by import path."""
