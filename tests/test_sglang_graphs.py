"""SGLang's decode CUDA graphs cover the rollout's batch: what megarl passes to sglang.Engine, and what start-up
says about the engine arguments it passes through (no SGLang needed)."""

from pathlib import Path

import pytest

from helpers import REPO
from megarl.config import load_config
from megarl.rollout import factory
from megarl.rollout.sglang import decode_graph_args

FIELDS_0517 = {"cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "cuda_graph_config", "disable_cuda_graph"}
"""Some of SGLang 0.5.17's ServerArgs fields: it has no cuda_graph_max_bs (refused as an engine argument)."""


def test_graphs_raised_to_the_rollout_batch():
    assert decode_graph_args(512, 1, {}, FIELDS_0517) == {"cuda_graph_max_bs_decode": 512}
    assert decode_graph_args(1024, 4, {"attention_backend": "triton"}, FIELDS_0517) == \
        {"cuda_graph_max_bs_decode": 1024}
    assert decode_graph_args(512, 1, {}, {"cuda_graph_max_bs"}) == {"cuda_graph_max_bs": 512}  # older SGLang


@pytest.mark.parametrize("max_batch,tp,engine_args,fields", [
    (None, 1, {}, FIELDS_0517),                                   # no rollout batch known (evaluation)
    (256, 1, {}, FIELDS_0517),                                    # SGLang's own limit covers it
    (512, 4, {}, FIELDS_0517),                                    # from TP 4 SGLang captures up to 512 itself
    (512, 1, {"cuda_graph_max_bs_decode": 160}, FIELDS_0517),     # the user's choice stands
    (512, 1, {"cuda_graph_bs_decode": [1, 2, 4]}, FIELDS_0517),
    (512, 1, {"cuda_graph_config": '{"decode": {"max_bs": 64}}'}, FIELDS_0517),
    (512, 1, {"disable_cuda_graph": True}, FIELDS_0517),          # no graphs asked for
    (512, 1, {}, {"disable_cuda_graph"}),                         # an SGLang without the argument
])
def test_graphs_left_alone(max_batch, tp, engine_args, fields):
    assert decode_graph_args(max_batch, tp, engine_args, fields) == {}


def test_graphs_kept_when_turned_on_explicitly():
    assert decode_graph_args(512, 1, {"disable_cuda_graph": False}, FIELDS_0517) == {"cuda_graph_max_bs_decode": 512}


def test_rollout_batch_per_engine():
    cfg = load_config(REPO / "recipes/smollm2_gsm8k_grpo.yaml")  # 64 prompts x 8 samples, engines of one GPU
    assert factory.max_batch(cfg, 1) == 512
    assert factory.max_batch(cfg, 8) == 64                        # 8 engines, 8 prompts each
    cfg = load_config(REPO / "recipes/qwen3_30b_a3b_grpo.yaml")   # rollout.tensor_parallel 2
    assert factory.max_batch(cfg, 8) == 16 * 8
    assert factory.max_batch(cfg, 6) == 22 * 8                    # 3 engines: 22, 21 and 21 prompts


def test_rollout_batch_counts_the_prompts_in_flight():
    """async_rl keeps (max_staleness + 1) steps of prompts in one generate call: graphs for a step's alone would
    leave half of the decode batch without them."""
    recipe = REPO / "recipes/smollm2_gsm8k_grpo.yaml"
    correction = "algorithm.rollout_correction=token_tis"
    cfg = load_config(recipe, ["async_rl.mode=colocated_async", correction])
    assert factory.max_batch(cfg, 1) == 2 * 64 * 8
    cfg = load_config(recipe, ["async_rl.mode=colocated_async", "async_rl.max_staleness=3", correction])
    assert factory.max_batch(cfg, 2) == 4 * 32 * 8
    cfg = load_config(recipe, ["async_rl.mode=separate", "async_rl.in_flight_prompts=128", correction])
    assert factory.max_batch(cfg, 1) == 128 * 8
    cfg = load_config(recipe, ["async_rl.mode=colocated_async", "async_rl.max_staleness=0"])
    assert factory.max_batch(cfg, 1) == 64 * 8                    # the sync loop's rollout


def test_make_engine_passes_the_batch_to_sglang_only(monkeypatch, tmp_path: Path):
    seen = {}

    class Engine:
        def __init__(self, hf_dir, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(factory, "engine_class", lambda cfg: Engine)
    monkeypatch.setenv("WORLD_SIZE", "2")
    sets = [f"checkpoint.dir={tmp_path}", "rollout.engine_args.attention_backend=triton", "rollout.fp8_block=64"]
    factory.make_engine(load_config(REPO / "recipes/smollm2_gsm8k_grpo.yaml", sets), 0, [0])
    assert seen["max_batch"] == 256 and seen["attention_backend"] == "triton"   # 32 of the 64 prompts x 8
    assert seen["weight_dtype"] == "bf16" and seen["fp8_block"] == 64  # rollout.weight_dtype's block (sglang_fp8)
    seen.clear()
    factory.make_engine(load_config(REPO / "recipes/tiny_cpu_grpo.yaml", [f"checkpoint.dir={tmp_path}"]), 0, None)
    assert "max_batch" not in seen and "fp8_block" not in seen    # vLLM: not its arguments


def test_deterministic_inference_is_warned_about_at_start_up():
    """enable_deterministic_inference changed what SGLang 0.5.17 sampled on an H100 (nearly every sample ran to
    the token cap): a run that sets it is warned, naming the field; not without it, with it off, or on vLLM."""
    from megarl.rollout.sglang_notes import deterministic_note

    recipe = REPO / "recipes/smollm2_gsm8k_grpo.yaml"
    on = "rollout.engine_args.enable_deterministic_inference=true"
    note = deterministic_note(load_config(recipe, [on]))
    assert note is not None and "rollout.engine_args.enable_deterministic_inference" in note
    assert deterministic_note(load_config(recipe)) is None
    assert deterministic_note(load_config(recipe, ["rollout.engine_args.enable_deterministic_inference=false"])) is None
    assert deterministic_note(load_config(recipe, ["rollout.engine=vllm", "rollout.engine_args={}"])) is None
