"""LoRA adapters on Megatron's linear layers (megarl.lora): B = 0 is the base model exactly; random adapters equal
the merged weights W + s B A; gradients reach only the adapters and equal a float64 reference; peft's LoRA on the
transformers model gives the same logits and adapter gradients; adapters_disabled is the base model; MoE experts
are refused. The Megatron checks run in one process of their own (tests/workers/lora_one_rank.py, a gloo world of
one); multi-rank layouts are in tests/test_lora_layouts.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, make_hf_model
from megarl.config.lora import LoraConfig
from megarl.config.yaml_io import FieldError, show

TARGET_NAMES = ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "self_attention.linear_proj.weight",
                "self_attention.linear_qkv.weight"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    models = [make_hf_model(root / family, family) for family in ("llama", "qwen2", "qwen3_moe")]
    out = root / "results.json"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "tests/workers/lora_one_rank.py", str(out), *map(str, models)], cwd=REPO,
                          env=os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_zero_b_is_the_base_model_exactly(results, family):
    row = results["zero_b"][family]
    assert row["params"] == row["expected_params"] and row["a_nonzero"] and row["b_zero"]
    assert row["exact"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # Qwen2's with rsLoRA scaling
def test_random_adapters_on_all_four_targets_equal_the_merged_weights(results, family):
    row = results["merged"][family]
    assert row["names"] == TARGET_NAMES and row["count"] == 4 * 4
    assert row["moved"] > 1e-2  # the adapters do change the model
    assert row["diff"] < 1e-6


def test_adapters_disabled_give_the_base_logits(results):
    row = results["disabled"]
    assert row["exact"] and row["on_moved"] > 1e-2


@pytest.mark.parametrize("target", ["qkv", "o", "fc1", "fc2"])
def test_gradients_reach_only_the_adapters_and_equal_a_float64_reference(results, target):
    assert results["gradients"]["base_frozen"]
    row = results["gradients"][target]
    assert row["ref_max"] > 1e-4
    assert row["a_rel"] < 1e-5 and row["b_rel"] < 1e-5


def test_o_and_fc2_match_peft_on_the_transformers_model(results):
    row = results["peft"]
    if row is None:
        pytest.skip("peft is not installed (not in requirements); the float64 reference test covers the gradients")
    assert row["grad_min"] > 1e-5 and row["moved"] > 1e-2  # peft's adapters are on and change the model
    assert row["logits"] < 1e-5 and row["loss"] < 1e-5 and row["grads"] < 1e-5


def test_moe_expert_layers_are_refused_and_the_model_left_as_it_was(results):
    row = results["moe"]
    assert "MoE expert layers" in row["refused"] and "fc1" in row["refused"]
    assert row["untouched"]
    assert row["attention_params"] == row["expected"]


def test_rank_zero_changes_nothing(results):
    assert results["rank_zero"] == {"params": 0, "trainable": True}


@pytest.mark.parametrize("kwargs,field,fix", [
    (dict(rank=-1), "rank", "use 0"),
    (dict(alpha=0.0), "alpha", "use 16"),
    (dict(dropout=1.0), "dropout", "use 0.0 (off)"),
    (dict(target_modules=["qkv", "fc3"]), "target_modules", "use 'fc2'"),
    (dict(target_modules=["down_proj"]), "target_modules", "use 'fc2'"),
    (dict(target_modules=["o", "o"]), "target_modules", "list each module once"),
    (dict(rank=8, target_modules=[]), "target_modules", "at least one"),
])
def test_config_errors_name_the_field_value_and_fix(kwargs, field, fix):
    with pytest.raises(FieldError) as err:
        LoraConfig(**kwargs)
    assert err.value.field == field and fix in str(err.value)
    assert f"= {show(kwargs[field])}," in str(err.value)


def test_scaling_is_alpha_over_r_or_over_sqrt_r():
    assert LoraConfig(rank=16, alpha=32.0).scaling == 2.0
    assert LoraConfig(rank=16, alpha=32.0, rslora=True).scaling == 8.0


def test_a_rank_at_a_target_layers_width_is_refused_before_any_worker_starts(tmp_path):
    """The tiny model's layers are at least 128 wide: rank 4096 (it was accepted silently) and rank 128 are no
    longer low-rank, on all targets or on fc1 alone (128 -> 512); rank 64 passes."""
    from megarl.loop.bootstrap import check_lora_rank, check_run
    from megarl.models.spec import load_spec

    spec = load_spec(str(REPO / "recipes/tiny/model"))
    with pytest.raises(FieldError, match=r"actor.lora.rank` = 4096, but it must be below the narrowest width of its "
                                         r"target layers \(128 for \['qkv', 'o', 'fc1', 'fc2'\]"):
        check_run(str(REPO / "recipes/tiny_cpu_grpo.yaml"), ["actor.lora.rank=4096", f"checkpoint.dir={tmp_path}"],
                  world=1, ranks_per_node=None, gpu_bytes=0)
    with pytest.raises(FieldError, match="below the narrowest width"):
        check_lora_rank(LoraConfig(rank=128), spec)
    check_lora_rank(LoraConfig(rank=64), spec)
    with pytest.raises(FieldError, match=r"128 for \['fc1'\]"):
        check_lora_rank(LoraConfig(rank=128, target_modules=["fc1"]), spec)
    check_lora_rank(LoraConfig(rank=0), spec)
