"""``mapping.to_hf`` refuses Megatron shards that do not cover every HF tensor exactly once.

to_hf fills HF tensors allocated uninitialised; where TP does not divide a size (intermediate_size 102 over TP 4:
each shard holds 25 rows, 100 in all), the last rows would otherwise be exported as whatever memory held."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import TINY
from megarl.models.mapping import ParamRule, hf_shapes, param_rules, to_hf, to_mcore_shard
from megarl.models.spec import ModelSpec, load_spec


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> ModelSpec:
    """QKV bias off, QK-norm on, tied embeddings: replicated norms come whole from every shard."""
    path = tmp_path_factory.mktemp("qwen3")
    (path / "config.json").write_text(json.dumps(TINY["qwen3"] | {"architectures": ["Qwen3ForCausalLM"]}))
    return load_spec(path)


def shards_of(spec: ModelSpec, rule_suffix: str, tp: int, padded_vocab: int) -> tuple[ParamRule, list[torch.Tensor]]:
    """Layer 0's (or the embedding's) rule ending in ``rule_suffix`` and its TP shards, cut from random HF tensors."""
    gen = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(shape, generator=gen) for name, shape in hf_shapes(spec).items()}

    def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        return hf[name] if dim is None else hf[name].narrow(dim, start, stop - start)

    rule = next(r for r in param_rules(spec) if r.mcore.endswith(rule_suffix) and r.layer in (None, 0))
    return rule, [to_mcore_shard(rule, spec, read, t, tp, padded_vocab) for t in range(tp)]


@pytest.mark.parametrize("suffix,hf_name", [("mlp.linear_fc1.weight", "model.layers.0.mlp.gate_proj.weight"),
                                            ("mlp.linear_fc2.weight", "model.layers.0.mlp.down_proj.weight")])
def test_an_ffn_width_tp_does_not_divide_is_refused_not_exported_half_written(qwen3, suffix, hf_name):
    spec = dataclasses.replace(qwen3, intermediate_size=102)
    rule, shards = shards_of(spec, suffix, 4, 0)
    with pytest.raises(ValueError, match=rf"{rule.mcore}: its 4 tensor-parallel shards do not cover HF tensor "
                                         rf"{hf_name} .*\[0, 100\)"):
        to_hf(rule, spec, shards)


def test_vocab_shards_short_of_the_vocabulary_are_refused(qwen3):
    rule, shards = shards_of(qwen3, "word_embeddings.weight", 2, 256)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight .*\[0, 160\)"):
        to_hf(rule, qwen3, [s[:80] for s in shards])  # 160 padded rows of a 170-row vocabulary


def test_qkv_shards_over_more_ranks_than_kv_heads_are_refused(qwen3):
    rule, shards = shards_of(qwen3, "0.self_attention.linear_qkv.weight", 2, 0)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight .*they hold nothing"):
        to_hf(rule, qwen3, shards * 2)  # 2 kv heads: as TP 4, no rank holds a whole query group

