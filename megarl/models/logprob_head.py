"""The last stage's output layer made to return per-token log-probabilities and entropy instead of logits
(``model.logprob_chunk_tokens`` > 0): its forward is swapped for megarl.models.chunked_logprobs.

The swap keeps the layer and its weight (or the tied embedding's, which GPTModel passes as ``weight=``) where
Megatron expects them, so checkpoints, the resharder and DDP see the usual parameter, used through ordinary autograd
inside the layer's call: DDP's hook adds its gradient to ``main_grad`` like any other, and finalize_model_grads
all-reduces a tied weight's over the first and last stage as usual. The hidden states reach the layer as
ColumnParallelLinear's input does, and their gradient leaves as its input gradient does: all-reduced over TP, or
reduce-scattered along the sequence under sequence parallelism.

GPTModel returns the layer's [s, b, 3] output as [b, s, 3]: (log p of the next token, entropy, the most likely
token) at every position, the last position's log p meaningless (nothing follows it). Each forward needs its tokens
first (``aim``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megarl.models.chunked_logprobs import chunked_logprobs
from megarl.models.gpt import unwrap


class LogprobHead:
    """What one output layer needs besides its weight; ``targets`` [s, b] are set before each forward and used once."""

    def __init__(self, *, vocab_start: int, vocab_size: int, temperature: float, chunk_tokens: int,
                 group: dist.ProcessGroup) -> None:
        self.vocab_start, self.vocab_size, self.temperature = vocab_start, vocab_size, temperature
        self.chunk_tokens, self.group = chunk_tokens, group
        self.targets: torch.Tensor | None = None

    def forward(self, layer: Any, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        assert self.targets is not None, "the output layer's tokens were not given (logprob_head.aim)"
        assert not runtime_gather_output, "log-probabilities need no gathered logits"
        targets, self.targets = self.targets, None
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=self.group)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.group)
        s, b, h = hidden.shape
        assert targets.shape == (s, b), (targets.shape, hidden.shape)
        out = chunked_logprobs(hidden.reshape(s * b, h), layer.weight if weight is None else weight,
                               targets.reshape(-1), vocab_start=self.vocab_start, vocab_size=self.vocab_size,
                               group=self.group, temperature=self.temperature, chunk_tokens=self.chunk_tokens)
        return out.view(s, b, 3), None


def install(chunks: list[torch.nn.Module], **head: Any) -> None:
    """Give the chunk holding the output layer (last stage, last virtual stage) a LogprobHead(**head)."""
    for chunk in chunks:
        model: Any = unwrap(chunk)
        if model.post_process:
            state = LogprobHead(**head)
            model.output_layer.logprob_head = state
            model.output_layer.forward = functools.partial(state.forward, model.output_layer)


@contextlib.contextmanager
def installed(chunks: list[torch.nn.Module], **head: Any) -> Iterator[None]:
    """``install`` for the duration of a block: the output layers give logits again after it."""
    install(chunks, **head)
    try:
        yield
    finally:
        for chunk in chunks:
            layer = getattr(unwrap(chunk), "output_layer", None)
            if layer is not None and hasattr(layer, "logprob_head"):
                del layer.forward, layer.logprob_head  # the class's forward shows through again


def aim(chunk: torch.nn.Module, tokens: torch.Tensor, thd: bool) -> None:
    """Give ``chunk``'s head (if it has one) the next-token targets of the [r, s] ``tokens`` about to go in (``thd``:
    as one [1, r * s] row); the last position of each row predicts nothing and gets token 0."""
    head = getattr(getattr(unwrap(chunk), "output_layer", None), "logprob_head", None)
    if head is None:
        return
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    head.targets = (targets.reshape(1, -1) if thd else targets).t()

