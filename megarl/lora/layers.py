"""Low-rank adapters on Megatron's ColumnParallelLinear and RowParallelLinear: output = W x + s * B A x, sharded
over tensor parallelism (TP) as the base layer is.

Column-parallel (qkv, fc1; W split by output rows): A [r, in] is replicated and B [out/tp, r] split like W, so each
rank yields its own output rows. Row-parallel (o, fc2; W split by input columns): A [r, in/tp] is split like W and
B [out, r] replicated. In both the communication is on the r-wide product A x, never on a hidden-wide tensor:

- column: the base gathers its input over the sequence under sequence parallelism (SP); gathering A x instead
  carries r instead of hidden channels and gives B the same full-sequence rows. Without SP, A x is the same on
  every rank and only its gradient, partial per output slice, is summed (the copy-to-TP region).
- row: A_i x_i is a partial sum over TP; it is summed (all-reduce, or reduce-scatter to this rank's sequence slice
  under SP, as the base reduces its own output) before B. Adding B A_i x_i to the base's partial output before its
  reduction would save that small collective, but would need a hook inside RowParallelLinear.forward and leave B's
  gradient partial over TP even without SP, which Megatron's gradient reduction does not sum.

Under SP the replicated factor sees only this rank's sequence slice, so its gradient is partial: it carries
``sequence_parallel = True``, as Megatron's norms do, and finalize_model_grads sums it over TP.

The adapters are child modules (``linear_qkv.lora``) whose forward hook adds to the base's output: the base
layers' classes and parameter names stay Megatron's, so HF loading and canonical names see the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.config.lora import TARGET_PATHS, TARGETS, LoraConfig
from megarl.errors import UserError
from megarl.models.gpt import unwrap


class LoraAdapter(torch.nn.Module):
    """One linear layer's factors A and B (this rank's shards) and the scale s; ``enabled`` False drops s B A x."""

    def __init__(self, base: Any, rank: int, scaling: float, generator: torch.Generator, dropout: float = 0.0
                 ) -> None:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, set_tensor_model_parallel_attributes

        super().__init__()
        self.column = isinstance(base, ColumnParallelLinear)
        self.scaling = scaling
        self.enabled = True
        self.dropout = dropout
        self.dropping = False
        """Inside ``dropout_on`` (the updates' forward and backward) the input to A is dropped out."""
        self.group = base.tp_group
        self.sequence_parallel = bool(base.sequence_parallel)
        tp_rank = dist.get_rank(self.group)
        weight = base.weight
        # peft's init (kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) of the whole A, drawn from a
        # generator of its own, so that every TP and PP layout starts from the same adapters.
        a_full = torch.empty(rank, base.input_size)
        torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=generator)
        if self.column:
            a, b_shape, split, dim = a_full, (base.output_size_per_partition, rank), "B", 0
        else:
            width = base.input_size_per_partition
            a, b_shape, split, dim = a_full[:, tp_rank * width:(tp_rank + 1) * width], (base.output_size, rank), "A", 1
        self.A = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
        # B = 0: before the first update the adapted model is the base model exactly.
        self.B = torch.nn.Parameter(torch.zeros(b_shape, device=weight.device, dtype=weight.dtype))
        set_tensor_model_parallel_attributes(getattr(self, split), True, dim, 1)
        replicated = self.A if split == "B" else self.B
        replicated.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """s * B A x for the base layer's input ``x``, in the base output's layout."""
        from megatron.core.tensor_parallel import mappings

        h = F.linear(self._drop(x) if self.dropping and self.dropout > 0 else x, self.A)
        if self.column:
            h = (mappings.gather_from_sequence_parallel_region(h, group=self.group) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(h, group=self.group))
        else:
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.group) if self.sequence_parallel
                 else mappings.reduce_from_tensor_model_parallel_region(h, group=self.group))
        return self.scaling * F.linear(h, self.B)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on A's input, drawn as Megatron draws its own dropout: a column-parallel layer's input without
        sequence parallelism is the same on every TP rank and so must its mask be (the default RNG, seeded alike
        over TP); a row-parallel layer's input columns, and SP's sequence slices, differ by rank and get masks of
        their own (the tracker's model-parallel RNG). Activation recompute restores both RNGs, so its replay
        drops the same elements."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if self.column and not self.sequence_parallel:
            return F.dropout(x, self.dropout, training=True)
        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.dropout, training=True)

    def weight_delta(self) -> torch.Tensor:
        """s * B A for this rank's shard of the base weight."""
        return self.scaling * self.B @ self.A

    def add_delta(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Forward hook of the base layer: its (output, bias) with s * B A x added to the output."""
        if not self.enabled:
            return output
        out, bias = output
        return out + self.delta(args[0]), bias


def apply_lora(chunks: Sequence[torch.nn.Module], cfg: LoraConfig, seed: int = 0) -> list[torch.nn.Parameter]:
    """Freeze every weight of this rank's GPTModel chunks and add adapters to the ``cfg.target_modules`` layers of
    each transformer layer; the adapters' parameters, the only ones left trainable. Call it before wrapping the
    chunks in DDP, which allocates gradient buffers for the trainable parameters. ``cfg.rank`` 0: nothing changes."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if cfg.rank == 0:
        return []
    # Every target is checked before any is adapted, so that a refusal leaves the model as it was.
    targets = []
    for chunk in chunks:
        assert unwrap(chunk) is chunk, "apply_lora takes the chunks before they are wrapped in DDP"
        for layer in chunk.decoder.layers:  # type: ignore[union-attr]
            for target in cfg.target_modules:
                holder, name = TARGET_PATHS[target]
                parent = getattr(layer, holder)
                if holder == "mlp" and hasattr(parent, "experts"):
                    raise UserError(f"LoRA on MoE expert layers is not supported yet: actor.lora.target_modules "
                                    f"{target!r} names layer {layer.layer_number}'s experts. Fix: set "
                                    "actor.lora.target_modules: [qkv, o] (attention only), or actor.lora: null.")
                base = getattr(parent, name)
                if type(base) not in (ColumnParallelLinear, RowParallelLinear):
                    raise UserError(f"LoRA adapts Megatron's local-spec linear layers; {target} is a "
                                    f"{type(base).__name__} (Transformer Engine). Fix: model.transformer_engine: off.")
                assert not hasattr(base, "lora"), f"layer {layer.layer_number} {target} already has an adapter"
                assert not getattr(base, "gather_output", False), "a column-parallel output gathered over TP"
                targets.append((layer.layer_number, target, base))
    for chunk in chunks:
        chunk.requires_grad_(False)
    params: list[torch.nn.Parameter] = []
    for layer_number, target, base in targets:
        # One generator per (seed, layer, target): the same adapters whichever rank holds the layer.
        generator = torch.Generator().manual_seed((seed * 1_000_003 + layer_number) * len(TARGETS)
                                                  + TARGETS.index(target))
        adapter = LoraAdapter(base, cfg.rank, cfg.scaling, generator, cfg.dropout)
        base.lora = adapter
        base.register_forward_hook(adapter.add_delta)
        params += [adapter.A, adapter.B]
    return params


def _adapters(chunks: Sequence[torch.nn.Module]) -> Iterator[LoraAdapter]:
    for chunk in chunks:
        yield from (m for m in unwrap(chunk).modules() if isinstance(m, LoraAdapter))


def merged_weights(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """W + s * B A of every adapted layer of one chunk, this rank's shard, by the base weight's name in the
    chunk (``decoder.layers.0.self_attention.linear_qkv.weight``): the weights of the adapted model as a plain one."""
    model = unwrap(chunk)
    with torch.no_grad():
        return {f"{name}.weight": module.weight + module.lora.weight_delta()
                for name, module in model.named_modules() if isinstance(getattr(module, "lora", None), LoraAdapter)}


@contextmanager
def dropout_on(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """The adapters' dropout (actor.lora.dropout) active inside the block: an update's forward and backward."""
    adapters = list(_adapters(chunks))
    for adapter in adapters:
        adapter.dropping = True
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.dropping = False


@contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """The base model: every adapter of ``chunks`` off inside the block (the reference policy of a LoRA actor)."""
    adapters = list(_adapters(chunks))
    before = [a.enabled for a in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, enabled in zip(adapters, before, strict=True):
            adapter.enabled = enabled
