"""Routing replay for MoE models: the trainer's routers take the experts the rollout engine chose.

A token's expert choice is a discrete function of the router's logits, so the engine's kernels and the
trainer's disagree on some tokens (bf16 ties, different summation orders); such a token's log-probability
then comes from different experts in the two, which dominates the rollout/trainer mismatch of MoE models.
With ``algorithm.routing_replay`` the engine returns, for every token it ran, the top-k experts of every
layer (SGLang's ``return_routed_experts``), and the actor's routers use them in its scoring and training
passes. The router still computes its own probabilities for the replayed experts, so gradients flow
through the router as usual.

Layouts: a sequence's routing is [len-1, num_layers, k] (the engine never runs the last sampled token);
a micro-batch's is [rows, width, num_layers, k] with -1 where the trainer routes by itself (padding, a
sequence's last token). Megatron's router sees the tokens of a micro-batch as [s, b] flattened sequence-major
(in THD format its rows end to end) and, under sequence parallelism, only this TP rank's slice of s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from megarl.data.batching import MicroBatch
from megarl.models.gpt import unwrap

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type that holds every expert index: every rank keeps each step's routing of every
    sample (Qwen3-30B-A3B: 48 layers x top-8 x 1 byte = 384 bytes per token)."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.int16 if num_experts <= 32768 else np.int32)


class LayerReplay:
    """One router's replay (megatron-core's ``router.router_replay`` hook): the experts of the micro-batch
    being run, or -1 to route a token by the router's own top-k.

    Under activation recompute the backward pass runs each micro-batch's forward again, in micro-batch order,
    possibly after later micro-batches' forwards (pipeline schedules): those runs, the only ones with grad
    enabled, take their micro-batch's routing from a queue.
    """

    def __init__(self, recompute: bool) -> None:
        self.recompute = recompute
        self.counting = False
        """Count disagreements (the scoring pass, where the trainer's weights are the engine's)."""
        self.current: torch.Tensor | None = None
        self.pending: deque[torch.Tensor] = deque()
        self.counts: torch.Tensor | None = None
        """[replayed tokens, those whose expert set the router itself would not have chosen], on the device (read
        once per step, not once per layer)."""

    def push(self, indices: torch.Tensor, counting: bool) -> None:
        self.current, self.counting = indices, counting
        if self.recompute:
            self.pending.append(indices)

    def clear(self) -> None:
        self.current = None
        self.pending.clear()

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None,
                        default_compute_topk: TopK) -> tuple[torch.Tensor, torch.Tensor]:
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.current is None:
            return own_scores, own
        replaying_recompute = self.recompute and torch.is_grad_enabled()
        target = self.pending.popleft() if replaying_recompute else self.current
        assert target.shape == own.shape, f"replayed routing {tuple(target.shape)} for tokens {tuple(own.shape)}"
        replayed = target >= 0
        indices = torch.where(replayed, target.long(), own)
        if self.counting:
            rows = replayed.all(dim=1)
            differ = (indices.sort(dim=1).values != own.sort(dim=1).values).any(dim=1)
            counts = torch.stack([rows.sum(), (differ & rows).sum()])
            self.counts = counts if self.counts is None else self.counts + counts
        return scores.gather(1, indices), indices


class RoutingReplay:
    """The replays of every MoE router of a model's chunks, by global layer index."""

    def __init__(self, chunks: list[torch.nn.Module], layer_offsets: list[int], *, recompute: bool,
                 sequence_parallel: bool, tp_rank: int, tp: int, thd: bool = False) -> None:
        """``thd``: micro-batches run in Megatron's packed format, their rows end to end (megarl.models.forward)."""
        self.sequence_parallel, self.tp_rank, self.tp, self.thd = sequence_parallel, tp_rank, tp, thd
        self._by_chunk: dict[int, list[tuple[int, LayerReplay]]] = {}
        for chunk, offset in zip(chunks, layer_offsets, strict=True):
            layers: list[tuple[int, LayerReplay]] = []
            decoder: Any = unwrap(chunk).decoder
            for local, layer in enumerate(decoder.layers):
                router = layer.mlp.router
                router.router_replay = LayerReplay(recompute)
                layers.append((offset + local, router.router_replay))
            self._by_chunk[id(unwrap(chunk))] = layers

    def _replays(self) -> list[LayerReplay]:
        return [replay for layers in self._by_chunk.values() for _, replay in layers]

    def set(self, model: torch.nn.Module, routing: torch.Tensor, device: torch.device, counting: bool = False
            ) -> None:
        """Before ``model`` (a chunk, wrapped or not) runs a micro-batch: [rows, width, num_layers, k] routing,
        moved to ``device`` once for all its layers; ``counting``: add its tokens to ``disagreement``."""
        routing = routing.to(device, non_blocking=True)
        for layer, replay in self._by_chunk[id(unwrap(model))]:
            per_token = routing[:, :, layer]
            per_token = (per_token.reshape(-1, 1, per_token.shape[-1]) if self.thd  # [r * s, 1, k]
                         else per_token.transpose(0, 1))  # [s, b, k], the router's token order
            if self.sequence_parallel:
                per_token = per_token.chunk(self.tp, dim=0)[self.tp_rank]
            replay.push(per_token.reshape(-1, per_token.shape[-1]), counting)

    def clear(self) -> None:
        for replay in self._replays():
            replay.clear()

    def disagreement(self) -> tuple[int, int]:
        """(replayed token-layer choices, those the trainer's routers would have chosen otherwise) since the
        last call."""
        total = [0, 0]
        for replay in self._replays():
            if replay.counts is not None:
                total = [t + int(c) for t, c in zip(total, replay.counts.tolist(), strict=True)]
            replay.counts = None
        return total[0], total[1]


def place_routing(batch: MicroBatch, routing: Sequence[np.ndarray], num_layers: int, topk: int) -> torch.Tensor:
    """Per-sequence [len-1, num_layers, k] routing (``routing[i]`` for sequence i) -> the micro-batch's
    [rows, width, num_layers, k] int32, -1 where no routing is given."""
    rows, width = batch.tokens.shape
    out = torch.full((rows, width, num_layers, topk), -1, dtype=torch.int32)
    for i, row, start, n in batch.spans:
        given = torch.from_numpy(np.ascontiguousarray(routing[i][: n - 1]).astype(np.int32))
        out[row, start: start + given.shape[0]] = given
    return out
