"""The PPO critic's value head: hidden state -> one scalar per token, in place of the LM head."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class ValueHead(torch.nn.Module):
    """A replicated ``hidden -> 1`` projection with GPTModel's output-layer calling convention.

    It is replicated over TP (one output cannot be split); with sequence parallelism the
    hidden states are gathered over TP first, so every TP rank computes the same values
    and the same gradients, and no extra reduction is needed.
    """

    def __init__(self, config: Any, tp_group: dist.ProcessGroup) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        # Zero init: the critic starts by predicting 0 for every token, a neutral baseline.
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Every TP rank computes the same full gradient, so the backward must split, not sum.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype)), None
