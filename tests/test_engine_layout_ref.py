"""The engine-layout tensors the resharder writes, against slices cut by hand from the HF tensors (one process).

An engine's own weight loader splits HF's q_proj/k_proj/v_proj with the same layout megarl writes, so a layout
error that both share (K and V swapped in the fused QKV, gate and up swapped) passes every engine test. Here the
reference is written out from the definition (DESIGN.md, "The resharding problem"): qkv_proj holds this rank's
q heads, then its k head(s), then its v head(s), kv heads replicated when the engine has more ranks than kv
heads; gate_up_proj holds this rank's gate rows, then its up rows; vocab rows are padded to 64 and split.
Each engine rank is fed by a trainer rank that holds a full replica (DP = R), so every copy is local."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import TINY
from megarl.distributed.parallel import ParallelDims
from megarl.models.mapping import hf_shapes, param_rules, to_mcore_shard
from megarl.models.spec import ModelSpec, load_spec
from megarl.reshard.executor import Resharder, engine_tensor_allocations
from megarl.reshard.planner import make_plan

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> dict[str, ModelSpec]:
    """The tiny test models' shapes (their config.json alone): llama has 4 q heads over 2 kv heads (R = 4
    replicates them), qwen2 a QKV bias and tied embeddings, qwen3 head_dim 32 with hidden 64."""
    out = {}
    for family, arch in ARCHITECTURES.items():
        path = tmp_path_factory.mktemp(family)
        config = TINY[family] | {"architectures": [arch], "num_hidden_layers": 2}
        (path / "config.json").write_text(json.dumps(config))
        out[family] = load_spec(path)
    return out


def hf_tensors(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Distinct values everywhere (an index ramp plus noise), so that any misplaced row shows."""
    gen = torch.Generator().manual_seed(0)
    return {name: torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) / 1000
            + torch.randn(shape, generator=gen) for name, shape in hf_shapes(spec).items()}


def hand_cut(hf: dict[str, torch.Tensor], spec: ModelSpec, R: int, r: int) -> dict[str, torch.Tensor]:
    """Engine rank r (of R)'s attention, MLP and vocab tensors, cut from the full HF tensors."""
    d, nh, nkv = spec.head_dim, spec.num_attention_heads, spec.num_kv_heads
    q_heads = range(r * nh // R, (r + 1) * nh // R)
    kv_heads = range(r * nkv // R, r * nkv // R + nkv // R) if R <= nkv else [r // (R // nkv)]

    def heads(t: torch.Tensor, which: range | list[int]) -> torch.Tensor:
        return torch.cat([t[h * d:(h + 1) * d] for h in which])

    out = {}
    padded = math.ceil(spec.vocab_size / 64) * 64
    names = ["model.embed_tokens.weight"] + ([] if spec.tie_word_embeddings else ["lm_head.weight"])
    for name in names:
        full = torch.zeros(padded, spec.hidden_size)
        full[:spec.vocab_size] = hf[name]
        out[name] = full[r * padded // R:(r + 1) * padded // R]
    inter = spec.intermediate_size // R
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q, k, v = (hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([heads(q, q_heads), heads(k, kv_heads),
                                                              heads(v, kv_heads)])
        out[p + "self_attn.o_proj.weight"] = heads(hf[p + "self_attn.o_proj.weight"].T, q_heads).T
        rows = slice(r * inter, (r + 1) * inter)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"][rows],
                                                        hf[p + "mlp.up_proj.weight"][rows]])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"][:, rows]
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_resharder_writes_the_engine_layout_cut_by_hand_from_hf(specs, family, R):
    spec = specs[family]
    hf = hf_tensors(spec)
    padded_vocab = spec.padded_vocab_size(1, 128)

    def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        return hf[name] if dim is None else hf[name].narrow(dim, start, stop - start)

    src = {rule.mcore: to_mcore_shard(rule, spec, read, 0, 1, padded_vocab) for rule in param_rules(spec)}
    plan = make_plan(spec, ParallelDims(tp=1, pp=1, dp=R), R, gpus_per_node=R, element_size=4)
    assert sorted(plan.engine_ranks) == list(range(R))
    for g in range(R):
        dst = engine_tensor_allocations(plan, g, torch.float32, torch.device("cpu"))
        for t in dst.values():
            t.fill_(float("nan"))  # an element the resharder does not write stays NaN
        Resharder(plan, g, src, dst).refit()
        expected = hand_cut(hf, spec, R, plan.engine_rank(g))
        assert set(expected) <= set(dst)
        wrong = [name for name, want in expected.items() if not torch.equal(dst[name], want)]
        assert not wrong, f"engine rank {plan.engine_rank(g)} of {R}: {wrong}"
        assert all(not t.isnan().any() for t in dst.values())
