"""Which pipeline rank holds each layer, against megatron-core's own placement, and the hand-over planned from it.

With virtual pipeline parallelism (parallel.virtual_pipeline) a rank holds several model chunks, interleaved: with
8 layers, PP 2 and VPP 2, rank 0 holds layers 0-1 and 4-5. The reference is megatron-core's
get_transformer_layer_offset / get_num_layers_to_build; the hand-over is then played out transfer by transfer from
trainer ranks holding exactly what Megatron builds there, and each engine rank compared with its tensors cut by
hand from the HF weights (test_engine_layout_ref.hand_cut)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_engine_layout_ref import hand_cut
from test_planner import check_exactly_once

from helpers import TINY, make_hf_model, run_worker
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.mapping import chunk_first_layer, hf_shapes, param_rules, pipeline_stage, to_mcore_shard
from megarl.models.spec import ModelSpec, load_spec
from megarl.reshard.executor import engine_tensor_allocations, padding_rows
from megarl.reshard.planner import Plan, make_plan


def megatron_chunks(num_layers: int, pp: int, vpp: int | None) -> dict[tuple[int, int], range]:
    """(pipeline rank, virtual stage) -> the global layers megatron-core builds in that chunk."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=16, num_attention_heads=2,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                               pipeline_dtype=torch.float32, use_cpu_initialization=True)
    out = {}
    for p in range(pp):
        for v in range(vpp or 1):
            stage = v if vpp else None
            first = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=p)
            out[p, v] = range(first, first + get_num_layers_to_build(config, vp_stage=stage, pp_rank=p))
    return out


def tiny_spec(tmp_path, layers: int) -> ModelSpec:
    """The tiny Llama (4 q heads over 2 kv heads, vocab 200) with ``layers`` layers."""
    config = TINY["llama"] | {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_spec(tmp_path)


PLACEMENTS = [(8, 2, None), (8, 2, 2), (8, 2, 4), (8, 4, 2), (12, 2, 3), (12, 3, 2), (16, 4, 2), (24, 2, 3)]


@pytest.mark.parametrize("layers,pp,vpp", PLACEMENTS)
def test_every_layer_is_on_the_pipeline_rank_and_chunk_megatron_core_builds_it(tmp_path, layers, pp, vpp):
    spec = tiny_spec(tmp_path, layers)
    chunks = megatron_chunks(layers, pp, vpp)
    assert sorted(i for run in chunks.values() for i in run) == list(range(layers))
    for (p, v), run in chunks.items():
        assert chunk_first_layer(spec, pp, vpp, p, v) == run.start, (p, v)
        for i in run:
            assert pipeline_stage(f"decoder.layers.{i}.mlp.linear_fc2.weight", spec, pp, vpp) == p, (i, p, v)
    assert pipeline_stage("embedding.word_embeddings.weight", spec, pp, vpp) == 0
    assert pipeline_stage("decoder.final_layernorm.weight", spec, pp, vpp) == pp - 1


def trainer_tensors(spec: ModelSpec, dims: ParallelDims, hf: dict[str, torch.Tensor],
                    padded_vocab: int) -> list[dict[str, torch.Tensor]]:
    """Every trainer rank's Megatron tensors by canonical name, holding the layers megatron-core builds on its
    pipeline rank (the embedding on the first, the final norm and head on the last)."""
    on_rank = {i: p for (p, _), run in megatron_chunks(spec.num_layers, dims.pp, dims.vpp).items() for i in run}

    def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        return hf[name] if dim is None else hf[name].narrow(dim, start, stop - start)

    out: list[dict[str, torch.Tensor]] = [{} for _ in range(dims.world_size)]
    for g in range(dims.world_size):
        at = dims.coords(g)
        for rule in param_rules(spec):
            stage = on_rank[rule.layer] if rule.layer is not None else 0 if rule.mcore.startswith("embedding.") \
                else dims.pp - 1
            if stage == at["pp"]:
                out[g][rule.mcore] = to_mcore_shard(rule, spec, read, at["tp"], dims.tp, padded_vocab).contiguous()
    return out


def play(plan: Plan, trainer: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Every GPU's engine tensors after the plan's transfers, bucket by bucket: a transfer reads its trainer
    rank's tensor (which that rank must hold), a relayed one the forwarding GPU's copy landed a bucket before."""
    engine = []
    for g in range(plan.num_gpus):
        dst = engine_tensor_allocations(plan, g, torch.float32, torch.device("cpu")) if plan.engine_rank(g) >= 0 \
            else {}
        for t in dst.values():
            t.fill_(float("nan"))  # an element no transfer writes stays NaN
        for name, start in padding_rows(plan, g).items():
            dst[name][start:].zero_()
        engine.append(dst)
    for bucket in plan.buckets:
        for t in bucket:
            dst = engine[t.dst_rank][t.dst_name]
            if t.via >= 0:
                src, offset = engine[t.via][t.dst_name], t.dst_offset
            else:
                assert t.src_name in trainer[t.src_rank], (
                    f"the plan reads {t.src_name} from trainer rank {t.src_rank}, which Megatron does not build there")
                src, offset = trainer[t.src_rank][t.src_name], t.src_offset
            if t.dim == 0:
                row = math.prod(src.shape[1:])
                dst.view(-1)[t.dst_offset * row:(t.dst_offset + t.length) * row] = \
                    src.reshape(-1)[offset * row:(offset + t.length) * row]
            else:
                dst[:, t.dst_offset:t.dst_offset + t.length] = src[:, offset:offset + t.length]
    return engine


# (tp, pp, dp, vpp, rollout TP); 8 layers: VPP 4 over PP 2 and VPP 2 over PP 4 put one layer in each chunk.
LAYOUTS = [(1, 2, 1, None, 2), (1, 2, 1, 2, 1), (1, 2, 1, 2, 2), (2, 2, 1, 2, 4), (1, 2, 2, 2, 1), (1, 2, 2, 2, 4),
           (1, 2, 1, 4, 2), (1, 4, 1, 2, 4), (2, 4, 1, 2, 4)]


@pytest.mark.parametrize("tp,pp,dp,vpp,r", LAYOUTS)
def test_hand_over_from_interleaved_pipeline_chunks_writes_the_engine_layout_cut_from_hf(tmp_path, tp, pp, dp, vpp,
                                                                                          r):
    spec = tiny_spec(tmp_path, 8)
    gen = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(shape, generator=gen) for name, shape in hf_shapes(spec).items()}
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, vpp=vpp)
    # 2 GPUs a node: with PP 2, DP 2 and R 1 each pipeline rank has a node, and the other's bytes are relayed in it.
    plan = make_plan(spec, dims, r, gpus_per_node=2, element_size=4, bucket_bytes=16 * 1024)
    check_exactly_once(plan)
    engine = play(plan, trainer_tensors(spec, dims, hf, plan.padded_vocab))
    for g, dst in enumerate(engine):
        expected = {name: hf[name] for name in dst if name in hf} | hand_cut(hf, spec, r, plan.engine_rank(g))
        assert sorted(expected) == sorted(dst)
        wrong = [name for name, want in expected.items() if not torch.equal(dst[name], want)]
        assert not wrong, f"GPU {g} (engine rank {plan.engine_rank(g)} of {r}): {wrong}"


@pytest.mark.slow
def test_a_megatron_model_in_interleaved_chunks_hands_over_exactly(tmp_path):
    """Real GPTModel chunks, PP 2 x VPP 2 over 8 layers (tests/workers/vpp_handover.py): rank 0 builds layers 0-1
    and 4-5, each loaded from its HF layer and named after it, and the hand-over writes every engine rank exactly."""
    model = make_hf_model(tmp_path / "llama", "llama", num_hidden_layers=8)
    rows = sorted(run_worker("vpp_handover.py", tmp_path, model, nproc=2), key=lambda row: row["rank"])
    assert [row["layers"] for row in rows] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for row in rows:
        assert row["named_alike"] and row["loaded"] and row["exact"] == {"1": True, "2": True}, row


def test_layers_that_pp_times_vpp_does_not_split_evenly_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"TP=1 PP=2 VPP=3 does not fit the model .*num_hidden_layers=8"):
        make_plan(tiny_spec(tmp_path, 8), ParallelDims(tp=1, pp=2, dp=1, vpp=3), 1)
