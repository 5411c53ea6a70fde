"""SGLang started in block FP8 (megarl.rollout.sglang_fp8), what can be checked without SGLang: the model directory
whose config.json carries the block-FP8 quantization_config, the engine arguments and their refusals, the engine-side
check of the layers' format, and the plan's FP8 names and scale offsets against SGLang 0.5.17's rules for them
(``Fp8LinearMethod.create_fp8_weight_``, ``MergedColumnParallelLinear`` / ``QKVParallelLinear``'s loaders of a
``BlockQuantScaleParameter``: a part's scales start at ceil(its row offset / block)); blocks of 128 and 64
(rollout.fp8_block)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from helpers import make_hf_model
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.spec import load_spec
from megarl.reshard import fp8
from megarl.reshard.planner import make_plan
from megarl.rollout.sglang_fp8 import Fp8ModelDir, check_block_fp8, fp8_engine_args, quantization_config

ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
               num_hidden_layers=2)
SERVER_ARGS = {"fp8_gemm_runner_backend", "load_format", "quantization", "kv_cache_dtype"}


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("llama") / "llama", "llama", dtype=torch.bfloat16, **ALIGNED)


@pytest.mark.parametrize("block", [128, 64])
def test_model_dir_links_the_model_with_a_block_fp8_config(aligned, block):
    before = (aligned / "config.json").read_text()
    model = Fp8ModelDir.create(aligned, block)
    try:
        entries = sorted(p.name for p in model.path.iterdir())
        assert entries == sorted(p.name for p in aligned.iterdir())  # no temporary file left behind
        for p in model.path.iterdir():
            if p.name != "config.json":
                assert p.is_symlink() and p.resolve() == (aligned / p.name).resolve()
        config = json.loads((model.path / "config.json").read_text())
        assert not (model.path / "config.json").is_symlink()
        assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                 "fmt": "e4m3", "weight_block_size": [block, block]}
        assert config == json.loads(before) | {"quantization_config": quantization_config(block)}
        assert (aligned / "config.json").read_text() == before  # the model itself is untouched
        assert load_spec(str(model.path)).hidden_size == 256
    finally:
        model.remove()
    assert not model.path.exists() and (aligned / "model.safetensors").exists()
    model.remove()  # twice: at shutdown and at exit


def test_model_dir_refuses_a_quantized_checkpoint(tmp_path, aligned):
    for p in aligned.iterdir():
        (tmp_path / p.name).symlink_to(p)
    (tmp_path / "config.json").unlink()
    config = json.loads((aligned / "config.json").read_text()) | {"quantization_config": {"quant_method": "awq"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"already has a quantization_config \(awq\).*needs an unquantized model"):
        Fp8ModelDir.create(tmp_path, 128)


def test_engine_args_pin_the_triton_runner_and_dummy_weights():
    assert fp8_engine_args({}, "auto", None, SERVER_ARGS) == {"load_format": "dummy",
                                                             "fp8_gemm_runner_backend": "triton",
                                                             "attention_backend": "triton"}
    assert fp8_engine_args({"fp8_gemm_runner_backend": "triton", "quantization": "fp8"}, "dummy", None,
                           SERVER_ARGS)["fp8_gemm_runner_backend"] == "triton"
    assert "attention_backend" not in fp8_engine_args({"attention_backend": "fa3"}, "auto", None, SERVER_ARGS)
    # Backends that scale attention by the layers' KV-cache scales, which the placeholder load leaves as noise
    for key in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        with pytest.raises(UserError, match=rf"\{{'{key}': 'flashinfer'\}} with rollout.weight_dtype = fp8: that "
                                            r"attention backend scales attention by the layers' KV-cache scales"):
            fp8_engine_args({key: "flashinfer"}, "auto", None, SERVER_ARGS)
    with pytest.raises(UserError, match=r"needs an SGLang whose block-FP8 GEMM runner can be chosen "
                                        r"\(fp8_gemm_runner_backend, in 0.5.17\)"):
        fp8_engine_args({}, "auto", None, {"load_format"})
    for runner in ("auto", "deep_gemm", "flashinfer_deepgemm"):
        with pytest.raises(UserError, match=rf"fp8_gemm_runner_backend = '{runner}' with rollout.weight_dtype = fp8"):
            fp8_engine_args({"fp8_gemm_runner_backend": runner}, "auto", None, SERVER_ARGS)
    with pytest.raises(UserError, match=r"rollout.alias_weights = true with rollout.weight_dtype = fp8"):
        fp8_engine_args({}, "auto", "aliases.pkl", SERVER_ARGS)
    with pytest.raises(UserError, match=r"\{'load_format': 'safetensors'\} with rollout.weight_dtype = fp8"):
        fp8_engine_args({}, "safetensors", None, SERVER_ARGS)
    with pytest.raises(UserError, match=r"\{'quantization': 'w8a8_fp8'\} with rollout.weight_dtype = fp8"):
        fp8_engine_args({"quantization": "w8a8_fp8"}, "auto", None, SERVER_ARGS)
    with pytest.raises(UserError, match=r"kv_cache_dtype = 'fp8_e4m3' with rollout.weight_dtype = fp8"):
        fp8_engine_args({"kv_cache_dtype": "fp8_e4m3"}, "auto", None, SERVER_ARGS)


def triton_block_fp8_linear():  # named as SGLang's runner (the check reads the function's name)
    pass


triton_block_fp8_linear.__name__ = "triton_w8a8_block_fp8_linear"


def _layer(out: int, inp: int, block: int = 128, **change: object) -> torch.nn.Module:
    """A block-FP8 linear layer as SGLang builds it: its quant method's ``weight_block_size`` is what its GEMM
    gets."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(out, inp, dtype=torch.float8_e4m3fn), requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(torch.ones(-(-out // block), -(-inp // block)), requires_grad=False)
    layer.quant_method = SimpleNamespace(w8a8_block_fp8_linear=triton_block_fp8_linear, use_marlin=False,
                                         weight_block_size=[block, block])
    for key, value in change.items():
        if key == "method":
            layer.quant_method = value
        elif key == "ue8m0":
            layer.weight_scale_inv.format_ue8m0 = True
        else:
            setattr(layer, key, value)
    return layer


def test_engine_check_of_the_layers_format():
    model = torch.nn.Module()
    model.qkv = _layer(512, 256)
    model.down = _layer(256, 300)  # a partial last block
    model.norm = torch.nn.LayerNorm(256)
    assert check_block_fp8(model) == 2
    assert check_block_fp8(torch.nn.Linear(4, 4)) == 0  # a bf16 engine: nothing to check
    deep_gemm = SimpleNamespace(w8a8_block_fp8_linear=lambda: None, use_marlin=False, weight_block_size=[128, 128])
    deep_gemm.w8a8_block_fp8_linear.__name__ = "deepgemm_w8a8_block_fp8_linear_with_fallback"
    cases = {"its GEMM runner is deepgemm_w8a8_block_fp8_linear_with_fallback": dict(method=deep_gemm),
             "its scales were requantized to UE8M0": dict(ue8m0=True),
             "it keeps a re-laid copy of its scales": dict(weight_scale_inv_deepgemm=torch.zeros(1)),
             r"its scales are torch.int32, not float32": dict(weight_scale_inv=torch.nn.Parameter(
                 torch.zeros(4, 2, dtype=torch.int32), requires_grad=False)),
             r"its scales are \[2, 4\], not \[4, 2\] \(128 x 128 blocks, its weight_block_size\)": dict(
                 weight_scale_inv=torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)),
             r"its quant method has no weight_block_size \(not block FP8\)": dict(method=SimpleNamespace(
                 w8a8_block_fp8_linear=triton_block_fp8_linear, use_marlin=False, weight_block_size=None)),
             "its weight is not float8_e4m3fn": dict(weight=torch.nn.Parameter(torch.zeros(512, 256),
                                                                             requires_grad=False))}
    for problem, change in cases.items():
        bad = torch.nn.Module()
        bad.layer = _layer(512, 256, **change)
        with pytest.raises(RuntimeError, match=rf"block-FP8 layer `layer` does not read the hand-over's format: "
                                               rf"{problem}.*fp8_gemm_runner_backend='triton'"):
            check_block_fp8(bad)


def test_engine_check_reads_each_layers_own_block():
    """rollout.fp8_block: 64: scales of 64 x 64 blocks pass where the layer's weight_block_size says 64, and scales of
    128-blocks under it (or 64-blocks under 128) are refused naming the block."""
    model = torch.nn.Module()
    model.qkv = _layer(960, 576, block=64)  # SmolLM2-135M's qkv_proj: scales [15, 9]
    model.down = _layer(576, 1500, block=64)  # a partial last block
    assert check_block_fp8(model) == 2
    for layer, problem in ((_layer(960, 576, block=64, weight_scale_inv=torch.nn.Parameter(
            torch.ones(8, 5), requires_grad=False)), r"\[8, 5\], not \[15, 9\] \(64 x 64 blocks"),
                           (_layer(512, 256, block=128, weight_scale_inv=torch.nn.Parameter(
                               torch.ones(8, 4), requires_grad=False)), r"\[8, 4\], not \[4, 2\] \(128 x 128 blocks")):
        bad = torch.nn.Module()
        bad.layer = layer
        with pytest.raises(RuntimeError, match=rf"layer `layer` does not read the hand-over's format: its scales are "
                                               rf"{problem}, its weight_block_size\)"):
            check_block_fp8(bad)


@pytest.mark.parametrize("block", [128, 64])
@pytest.mark.parametrize("R", [1, 2, 4])
def test_plan_names_and_scale_offsets_are_sglangs(aligned, R, block):
    """SGLang's names (``model.layers.N.self_attn.qkv_proj.weight_scale_inv``), and each merged part's scales at
    ceil(offset / block) of SGLang's per-rank output sizes, as its loaders place a checkpoint's q, k, v (gate, up)."""
    spec = load_spec(aligned)
    plan = make_plan(spec, ParallelDims(tp=1, pp=1, dp=R), R, weight_dtype="fp8", fp8_block=block)
    q = spec.num_attention_heads * spec.head_dim // R
    kv = max(spec.num_kv_heads // R, 1) * spec.head_dim
    inter = spec.intermediate_size // R
    sizes = {"self_attn.qkv_proj": ([q, kv, kv], spec.hidden_size), "self_attn.o_proj": ([spec.hidden_size], q),
             "mlp.gate_up_proj": ([inter, inter], spec.hidden_size), "mlp.down_proj": ([spec.hidden_size], inter)}
    for rank in range(R):
        geometry = plan.fp8_tensors(rank)
        want = {f"model.layers.{i}.{m}.weight" for i in range(spec.num_layers) for m in sizes}
        assert set(geometry) == want
        for name, g in geometry.items():
            outputs, inp = sizes[name.split(".", 3)[3].removesuffix(".weight")]
            assert g.scale_name == name + "_scale_inv"
            assert g.shape == (sum(outputs), inp)  # create_fp8_weight_: [output_size_per_partition, input_size_...]
            assert g.scale_shape == (-(-sum(outputs) // block), -(-inp // block)) and g.block == (block, block)
            offsets = [sum(outputs[:k]) for k in range(len(outputs))]
            assert [p.dst_row for p in g.parts] == offsets
            assert [p.scale_row for p in g.parts] == [-(-o // block) for o in offsets]
    assert not fp8.layout_problems(spec, R, block)
