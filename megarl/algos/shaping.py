"""DAPO's reward shaping and sample selection (Yu et al. 2025): a soft penalty for responses that run
into the length limit, and dynamic sampling, which keeps only groups whose rewards differ."""

from __future__ import annotations

import torch


@torch.no_grad()
def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int, penalty: float) -> torch.Tensor:
    """Soft overlong punishment [N] (<= 0) for response lengths [N].

    Responses up to max_new_tokens - buffer_tokens get 0; longer ones lose penalty linearly over
    the buffer, reaching -penalty at max_new_tokens (the response budget: no response is longer). buffer 0 = off.
    """
    if buffer_tokens <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    assert buffer_tokens <= max_new_tokens, "the config checks overlong_buffer_tokens <= max_new_tokens"
    over = (lengths.float() - (max_new_tokens - buffer_tokens)).clamp(min=0, max=buffer_tokens)
    return -penalty * over / buffer_tokens


@torch.no_grad()
def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool [num_groups]: True where a prompt's group_size adjacent scores [N] are not all equal.

    A group whose samples all score the same has GRPO advantage 0 everywhere: no learning signal.
    """
    groups = scores.reshape(-1, group_size)
    return (groups != groups[:, :1]).any(dim=1)
