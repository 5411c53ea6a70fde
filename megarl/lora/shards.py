"""A LoRA factor's tensor-parallel shards, joined into HF's layout and split again as its base weight's are
(megarl.models.mapping): how a LoRA checkpoint resumes in another layout and exports as a PEFT adapter.

A column-parallel layer (fused qkv, fused gate/up fc1) splits B's rows as its weight's rows and replicates A; a
row-parallel one (o, fc2) splits A's columns as its weight's columns and replicates B. The split factor goes
through the weight's own mapping with the adapter's rank as its other dimension, so the fused layers' TP
interleaving (q/k/v per query group, gate and up per rank) is undone and redone exactly.
"""

from __future__ import annotations

import torch

from megarl.models.mapping import FC1, QKV, ParamRule, assemble, hf_shapes, mcore_pieces, mcore_shape, to_hf
from megarl.models.spec import ModelSpec


def base_weight(factor: str) -> str:
    """The canonical weight a factor adapts: decoder.layers.N.<module>.lora.A -> decoder.layers.N.<module>.weight."""
    return factor.split(".lora.")[0] + ".weight"


def is_split(rule: ParamRule, factor: str) -> bool:
    """Whether ``factor`` (…lora.A or …lora.B) of ``rule``'s layer is split over TP."""
    return factor.endswith(".B") == (rule.kind in (QKV, FC1))


def factor_to_hf(spec: ModelSpec, rule: ParamRule, shards: list[torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """The split factor of ``rule``'s layer from its TP shards (by TP rank), one tensor per HF weight: [rows, rank]
    (B of q/k/v_proj, gate/up_proj) or [rank, columns] (A of o_proj, down_proj)."""
    column = rule.kind in (QKV, FC1)
    weights = hf_shapes(spec)
    shapes: dict[str, tuple[int, ...]] = {hf: (weights[hf][0], rank) if column else (rank, weights[hf][1])
                                          for hf in rule.hf}
    return to_hf(rule, spec, shards, shapes)


def reshard_factor(spec: ModelSpec, rule: ParamRule, factor: str, shards: list[torch.Tensor], tp_rank: int,
                   tp: int) -> torch.Tensor:
    """TP shard ``tp_rank`` of ``tp`` of ``factor`` from its shards in another TP size (by TP rank): a replicated
    factor is any shard, a split one joined in HF's layout and cut as the base weight's shard is."""
    if not is_split(rule, factor):
        return shards[0]
    rank = shards[0].shape[1 if rule.kind in (QKV, FC1) else 0]
    full = factor_to_hf(spec, rule, shards, rank)
    rows, columns = mcore_shape(rule, spec, tp, 0)
    shape = (rows, rank) if rule.kind in (QKV, FC1) else (rank, columns)
    return assemble(mcore_pieces(rule, spec, tp_rank, tp, 0), shape,
                    lambda hf, dim, start, stop: full[hf] if dim is None else full[hf].narrow(dim, start, stop - start))
