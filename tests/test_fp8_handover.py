"""FP8 rollout's hand-over (issue 54, items 1-3, on CPU): rollout.weight_dtype, rollout.fp8_block and their start-up
refusals, the plan's block geometry per quantized engine tensor, and the executor quantizing into engine parameters as
SGLang names them (float8_e4m3fn ``...weight``, float32 ``...weight_scale_inv``), checked bit for bit against
megarl.reshard.fp8's quantization of the full bf16 weight sliced to the rank and the float64 reference's, with
checksums from the float64 reference; blocks of 128 and of 64 (SmolLM2-135M's shapes)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import make_hf_model, run_worker
from megarl.config.rollout import RolloutConfig
from megarl.config.yaml_io import FieldError
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.mapping import hf_shapes
from megarl.models.presets import preset_or_hf_spec
from megarl.models.spec import load_spec
from megarl.reshard import fp8, fp8_reference
from megarl.reshard.executor import Resharder, engine_tensor_allocations
from megarl.reshard.planner import check_fp8_rollout, fp8_rollout_warning, make_plan
from megarl.reshard.verify import engine_names

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from engine_reference import EngineModel, Reports, load_hf, trainer_shards  # noqa: E402

from megarl.reshard.handover import HandoverState, apply_message  # noqa: E402

pytest.importorskip("megarl._C")

# Shapes the engines' FP8 loaders take at rollout TP 1, 2 and 4: q rows 4 x 128 (128 per rank at TP 4), 2 kv heads of
# 128 (one replicated per rank at TP 4), intermediate 512; hidden 256. Vocab 200 is not a multiple of anything.
ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
               num_hidden_layers=2)
# SmolLM2-135M's layer shapes (576 q rows, 192 k/v rows, intermediate 1536): multiples of 64, not of 128.
SMOL = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            num_hidden_layers=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("llama") / "llama", "llama", **ALIGNED)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("smol") / "smol", "llama", **SMOL)


def test_weight_dtype_config():
    assert RolloutConfig().weight_dtype == "bf16"
    assert RolloutConfig(weight_dtype="fp8").weight_dtype == "fp8"
    with pytest.raises(FieldError, match=r'weight_dtype` = "fp16".*must be bf16 or fp8'):
        RolloutConfig(weight_dtype="fp16")  # type: ignore[arg-type]
    with pytest.raises(FieldError, match=r'weight_dtype` = "fp8".*be bf16 with rollout.engine = vllm.*Fix: use '
                                         r"rollout.engine: sglang, or weight_dtype: bf16"):
        RolloutConfig(engine="vllm", weight_dtype="fp8")
    assert RolloutConfig().fp8_block == 128 and RolloutConfig(weight_dtype="fp8", fp8_block=64).fp8_block == 64
    for block in (96, 0, 256):
        with pytest.raises(FieldError, match=rf"`fp8_block` = {block}, but it must be 128 or 64 .*Fix: use 128 \(the "
                                             r"default\), or 64 for a model whose layer shapes are multiples of 64"):
            RolloutConfig(weight_dtype="fp8", fp8_block=block)


def _cfg(**rollout: object) -> SimpleNamespace:
    lora = rollout.pop("adapter", False)
    correction = rollout.pop("correction", "none")
    return SimpleNamespace(rollout=SimpleNamespace(**({"weight_dtype": "fp8", "engine": "sglang",
                                                       "tensor_parallel": 1, "alias_weights": "auto",
                                                       "engine_args": {}, "fp8_block": 128} | rollout)),
                           actor=SimpleNamespace(adapter_handover=lambda: lora),
                           algorithm=SimpleNamespace(rollout_correction=correction))


def test_start_up_refusals_and_warning(tmp_path, aligned):
    tiny = load_spec(make_hf_model(tmp_path / "tiny", "llama"))  # k/v rows 32: no FP8 layout in either block
    spec = load_spec(aligned)
    check_fp8_rollout(_cfg(weight_dtype="bf16"), tiny)  # bf16: nothing to refuse
    with pytest.raises(UserError, match=r"rollout.weight_dtype = fp8 with rollout.tensor_parallel = 1: the engines' "
                                        r"FP8 loaders .* refuse this model's shapes: q_proj rows per engine rank = 64 "
                                        r"is not a multiple of the FP8 block 128.*rollout.weight_dtype: bf16"):
        check_fp8_rollout(_cfg(), tiny)
    with pytest.raises(UserError, match=r"\(rollout.fp8_block = 64: 64 x 64 blocks\) refuse this model's shapes: "
                                        r"k_proj/v_proj rows per engine rank = 32 is not a multiple of the FP8 block "
                                        r"64. Use rollout.weight_dtype: bf16.$"):
        check_fp8_rollout(_cfg(fp8_block=64), tiny)  # 128 does not fit either: no block suggested
    with pytest.raises(UserError, match=r"actor.lora.handover = adapter.*Set actor.lora.handover: merged"):
        check_fp8_rollout(_cfg(adapter=True), spec)
    moe = load_spec(make_hf_model(tmp_path / "moe", "qwen3_moe"))
    with pytest.raises(UserError, match=r"MoE experts.*Set rollout.weight_dtype: bf16"):
        check_fp8_rollout(_cfg(), moe)
    check_fp8_rollout(_cfg(), spec)  # SGLang starts in block FP8 (megarl.rollout.sglang_fp8)
    with pytest.raises(UserError, match=r"rollout.alias_weights = true with rollout.weight_dtype = fp8.*Set "
                                        r"rollout.alias_weights: auto"):
        check_fp8_rollout(_cfg(alias_weights=True), spec)
    with pytest.raises(UserError, match=r"rollout.engine_args.fp8_gemm_runner_backend = 'deep_gemm' with "
                                        r"rollout.weight_dtype = fp8: .*UE8M0.*Remove it from rollout.engine_args"):
        check_fp8_rollout(_cfg(engine_args={"fp8_gemm_runner_backend": "deep_gemm"}), spec)
    # A block, then a TP, at which the shapes load is suggested where the asked one does not fit.
    with pytest.raises(UserError, match=r"tensor_parallel = 2: .* k_proj/v_proj rows per engine rank = 64 is not a "
                                        r"multiple of the FP8 block 128. Use rollout.fp8_block: 64, "
                                        r"rollout.tensor_parallel in \[1\], or rollout.weight_dtype: bf16.$"):
        make_plan(load_spec(make_hf_model(tmp_path / "narrow", "llama", **(ALIGNED | {"head_dim": 64}))),
                  ParallelDims(tp=1, pp=1, dp=2), 2, weight_dtype="fp8")
    warning = fp8_rollout_warning(_cfg())
    assert warning is not None and "algorithm.rollout_correction: token_tis" in warning
    assert fp8_rollout_warning(_cfg(correction="token_tis")) is None
    assert fp8_rollout_warning(_cfg(weight_dtype="bf16")) is None


def test_smollm2_loads_in_blocks_of_64_at_tp_1():
    """SmolLM2-135M (576 q rows, 192 k/v rows, intermediate 1536): refused in blocks of 128 with the block that fits
    suggested, planned in blocks of 64 at TP 1. At TP 2 and 4 its 9 heads do not split (the engine layout's refusal,
    which start-up runs first); at TP 3, where they do, 192 q rows and 64 k/v rows per rank fit 64 and not 128."""
    spec = preset_or_hf_spec("smollm2-135m", num_layers=1)
    with pytest.raises(UserError, match=r"tensor_parallel = 1: the engines' FP8 loaders \(rollout.fp8_block = 128: "
                                        r"128 x 128 blocks\) refuse this model's shapes: q_proj rows per engine rank = "
                                        r"576 is not a multiple of the FP8 block 128; k_proj/v_proj rows per engine "
                                        r"rank = 192 is not a multiple of the FP8 block 128. Use rollout.fp8_block: "
                                        r"64, or rollout.weight_dtype: bf16.$"):
        check_fp8_rollout(_cfg(), spec)
    check_fp8_rollout(_cfg(fp8_block=64), spec)
    assert fp8.layout_problems(spec, 3, 64) == []
    assert fp8.layout_problems(spec, 3, 128) == [f"{what} per engine rank = {n} is not a multiple of the FP8 block 128"
                                                 for what, n in (("q_proj rows", 192), ("k_proj/v_proj rows", 64),
                                                                 ("o_proj columns", 192))]
    for R in (2, 4):
        with pytest.raises(UserError, match=rf"rollout.tensor_parallel = {R} cannot hold this model: "
                                            "num_attention_heads=9 is not divisible by it"):
            make_plan(spec, ParallelDims(tp=1, pp=1, dp=R), R, weight_dtype="fp8", fp8_block=64)
    plan = make_plan(spec, ParallelDims(tp=1, pp=1, dp=1), 1, weight_dtype="fp8", fp8_block=64)
    geometry = plan.fp8_tensors(0)
    assert {n.split(".", 3)[3]: (g.block, g.shape, g.scale_shape) for n, g in geometry.items()} == {
        "self_attn.qkv_proj.weight": ((64, 64), (960, 576), (15, 9)),
        "self_attn.o_proj.weight": ((64, 64), (576, 576), (9, 9)),
        "mlp.gate_up_proj.weight": ((64, 64), (3072, 576), (48, 9)),
        "mlp.down_proj.weight": ((64, 64), (576, 1536), (9, 24))}
    qkv = geometry["model.layers.0.self_attn.qkv_proj.weight"]
    assert [(p.dst_row, p.scale_row) for p in qkv.parts] == [(0, 0), (576, 9), (768, 12)]


@pytest.mark.parametrize("R", [1, 2, 4])
def test_plan_carries_block_geometry(aligned, R):
    spec = load_spec(aligned)
    plan = make_plan(spec, ParallelDims(tp=2, pp=1, dp=2), R, weight_dtype="fp8")
    bf16 = make_plan(spec, ParallelDims(tp=2, pp=1, dp=2), R)
    assert bf16.fp8 == [] and plan.buckets == bf16.buckets  # the same bytes move; only the geometry is added
    full = hf_shapes(spec)
    for r, geometry in enumerate(plan.fp8):
        assert sorted(geometry) == sorted(n for n in plan.dst_shapes[r] if n.endswith(fp8.QUANTIZED))
        assert len(geometry) == 4 * spec.num_layers  # qkv, o, gate_up, down; embeddings, norms, lm_head stay
        (q0, q1), (k0, k1) = fp8.qkv_rows(4, 2, 128, r, R)
        qkv = geometry["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.scale_name == "model.layers.0.self_attn.qkv_proj.weight_scale_inv" and qkv.block == (128, 128)
        assert [(p.hf.split(".")[-2], p.rows, p.cols, p.dst_row, p.scale_row) for p in qkv.parts] == [
            ("q_proj", (q0, q1), (0, 256), 0, 0), ("k_proj", (k0, k1), (0, 256), q1 - q0, (q1 - q0) // 128),
            ("v_proj", (k0, k1), (0, 256), q1 - q0 + k1 - k0, (q1 - q0 + k1 - k0) // 128)]
        assert qkv.shape == plan.dst_shapes[r][qkv.name] and qkv.scale_shape == (qkv.shape[0] // 128, 2)
        down = geometry["model.layers.1.mlp.down_proj.weight"]
        assert [(p.rows, p.cols) for p in down.parts] == [((0, 256), fp8.tp_range(512, r, R))]
        assert down.scale_shape == (2, 4 // R)
        gate_up = geometry["model.layers.1.mlp.gate_up_proj.weight"]
        assert [p.rows for p in gate_up.parts] == [fp8.tp_range(512, r, R)] * 2
        assert all(full[p.hf][1] == p.cols[1] - p.cols[0] or p.cols[0] % 128 == 0 for g in geometry.values()
                   for p in g.parts)
    # The engine's checksums cover every scale too.
    assert all(set(names) >= {g.scale_name for g in plan.fp8_tensors(rank).values()}
               for rank, names in enumerate(engine_names(plan)))


def _reference(hf: dict[str, torch.Tensor], geometry: fp8.Fp8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 engine tensor from the float64 reference: each part's window of its full HF weight quantized on its own
    block grid (TP 1: the windows are whole weights), placed where the geometry says."""
    weight = torch.empty(geometry.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(geometry.scale_shape, dtype=torch.float32)
    for part in geometry.parts:
        w, s = fp8_reference.quantize(hf[part.hf][part.rows[0]:part.rows[1], part.cols[0]:part.cols[1]],
                                      geometry.block)
        weight[part.dst_row:part.dst_row + part.num_rows] = w
        scales[part.scale_row:part.scale_row + s.shape[0]] = s
    return weight, scales


@pytest.mark.parametrize(("model", "block"), [("aligned", 128), ("aligned", 64), ("smol", 64)])
def test_one_rank_quantizes_into_the_engines_fp8_parameters(request, model, block):
    """TP1 trainer, TP1 engine, one process: o_proj, gate_up and down_proj are the trainer's own tensors and are
    quantized from them directly; QKV (grouped per kv head in Megatron) goes through the staging arena, which holds
    the tensors in flight, not all of them. The in-engine mode gives the engine the same bytes. Refusals: an engine
    tensor of the wrong dtype or missing, in either mode, and an engine whose scales are of the other block. In
    blocks of 128 and 64, and SmolLM2-135M's shapes in blocks of 64."""
    path = request.getfixturevalue(model)
    spec = load_spec(path)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    plan = make_plan(spec, dims, 1, element_size=2, bucket_bytes=64 * 1024, weight_dtype="fp8", fp8_block=block)
    hf = {n: t.to(torch.bfloat16) for n, t in load_hf(str(path)).items()}
    src = trainer_shards(spec, dims, 0, hf, torch.bfloat16, plan.padded_vocab)
    dst = engine_tensor_allocations(plan, 0, torch.bfloat16, torch.device("cpu"))
    assert dst["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert dst["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].dtype == torch.float32
    assert dst["model.embed_tokens.weight"].dtype == torch.bfloat16
    resharder = Resharder(plan, 0, src, dst)
    assert sorted(resharder._direct) == sorted(f"model.layers.{i}.{n}" for i in range(2) for n in
                                               ("self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                                                "mlp.down_proj.weight"))
    hidden, inter, qkv_rows = spec.hidden_size, spec.intermediate_size, (spec.num_attention_heads
                                                                          + 2 * spec.num_kv_heads) * spec.head_dim
    qkv_bytes = qkv_rows * hidden * 2
    assert resharder.staging_bytes == qkv_bytes  # one QKV in flight at a time, of two
    resharder.refit()
    b = (block, block)
    for i in range(2):
        p = f"model.layers.{i}."
        want = {p + "self_attn.qkv_proj.weight": fp8.qkv_shard(*(hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"),
                                                               0, 1, spec.head_dim, block=b),
                p + "self_attn.o_proj.weight": fp8.quantize(hf[p + "self_attn.o_proj.weight"], block=b),
                p + "mlp.gate_up_proj.weight": fp8.gate_up_shard(hf[p + "mlp.gate_proj.weight"],
                                                                 hf[p + "mlp.up_proj.weight"], 0, 1, block=b),
                p + "mlp.down_proj.weight": fp8.quantize(hf[p + "mlp.down_proj.weight"], block=b)}
        for name, (w, s) in want.items():
            assert s.shape == (-(-w.shape[0] // block), -(-w.shape[1] // block)), name
            reference = _reference(hf, plan.fp8_tensors(0)[name])
            for got, expected in ((dst[name], w), (dst[name], reference[0])):
                assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name
            assert torch.equal(dst[name + "_scale_inv"], s) and torch.equal(s, reference[1]), name
    down = "model.layers.1.mlp.down_proj.weight"
    bad = dict(dst) | {down: torch.empty(hidden, inter, dtype=torch.bfloat16)}
    with pytest.raises(UserError, match=rf"`{down}` is torch.bfloat16 of shape \[{hidden}, {inter}\]; "
                                        r"rollout.weight_dtype = fp8 needs torch.float8_e4m3fn of shape "
                                        rf"\[{hidden}, {inter}\], contiguous \({block} x {block} blocks\)"):
        Resharder(plan, 0, src, bad)
    missing = {n: t for n, t in dst.items() if not n.endswith("qkv_proj.weight_scale_inv")}
    with pytest.raises(UserError, match=r"`model.layers.0.self_attn.qkv_proj.weight_scale_inv` is missing"):
        Resharder(plan, 0, src, missing)
    # In-engine (SGLang's hand-over): the trainer quantizes into its fp8_out, step by step, and the engine's copy
    # moves the bytes into its parameters. One bucket holds every (local) transfer here; a limit of two buckets
    # (128 KiB) cuts the quantizations into steps, so fp8_out holds a step's tensors (the aligned Llama's QKV alone:
    # 256 KiB of FP8), not the model's.
    side = Resharder(plan, 0, src, None, in_engine=True, landing_bytes=2 * plan.bucket_bytes)
    params = {n: torch.full_like(t, float("nan")) if t.dtype != torch.float8_e4m3fn else
              torch.full_like(t.view(torch.uint8), 0x7F).view(t.dtype) for n, t in dst.items()}
    state, model = HandoverState(), EngineModel(params)
    state.handle(model, side.engine_copy().to_wire("actor"))
    assert side.num_rounds > 2
    assert side.staging_bytes == qkv_bytes and 0 < side._fp8_out_bytes < qkv_rows * hidden + 2 * inter * hidden
    for r in range(side.num_rounds):
        side.refit(r)
        state.handle(model, apply_message("actor", torch.zeros(1), r))
    assert sorted(params) == sorted(dst)
    for name in dst:
        assert torch.equal(params[name].view(torch.uint8), dst[name].view(torch.uint8)), name
    side.verify(Reports(side.checksum_names, params), 0)
    # An engine that holds a linear layer in bf16 is refused when the copy attaches, naming the layer and the format.
    unquantized = dict(params) | {down: torch.empty(hidden, inter, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=rf"`{down}` is bfloat16, but the hand-over writes float8_e4m3fn "
                                         r"\(rollout.weight_dtype = fp8\): the engine must hold its linear layers in "
                                         rf"block FP8 \(float8_e4m3fn weights, float32 weight_scale_inv per {block} x "
                                         rf"{block} block\)"):
        HandoverState().handle(EngineModel(unquantized), side.engine_copy().to_wire("actor"))
    # An engine in the other block (its config.json's weight_block_size): its scales have another shape.
    other = 64 if block == 128 else 128
    if not fp8.layout_problems(spec, 1, other):  # SmolLM2's shapes have no plan in blocks of 128
        wrong = make_plan(spec, dims, 1, weight_dtype="fp8", fp8_block=other).fp8_tensors(0).values()
        scales = {g.scale_name: torch.empty(g.scale_shape, dtype=torch.float32) for g in wrong}
        with pytest.raises(ValueError, match=r"weight_scale_inv` is \[.*\] \(contiguous: True\); the plan writes a "
                                             rf"contiguous \[.*\] "
                                             rf"\(scales of {block} x {block} blocks: the engine's weight_block_size "
                                             r"must be rollout.fp8_block\)"):
            HandoverState().handle(EngineModel(dict(params) | scales), side.engine_copy().to_wire("actor"))


@pytest.mark.slow
@pytest.mark.parametrize("block", [128, 64])
def test_fp8_hand_over_over_trainer_layouts_and_rollout_tp(tmp_path, aligned, block):
    rows = run_worker("reshard_fp8.py", tmp_path, aligned, block)
    assert {(r["tp"], r["pp"], r["R"], r["block"]) for r in rows} == {(tp, pp, R, block) for tp in (1, 2)
                                                                      for pp in (1, 2) for R in (1, 2, 4)}
    assert len(rows) == 4 * 12
    for r in rows:
        # Every engine FP8 weight and scale = fp8's quantization of the full bf16 weight sliced to the engine rank,
        # and the float64 reference's; every other tensor = the engine's slicing of HF, in bf16.
        assert r["wrong"] == [] and r["wrong_ref"] == [], r
        assert r["in_engine"] and r["fp8_out_bytes"] > 0, r
        assert len(r["fp8"]) == 8 and r["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float8_e4m3fn"], r
        assert r["checksums"] == len(r["names"]) + 8, r  # each FP8 tensor's scales are checksummed too
        assert r["caught"] == {"fp8_byte": True, "scale_bit": True, "wrong_quantization": True}, r
        assert r["doubled"], r
        # Quantized straight from the trainer's tensors where the engine's window is one of them: with TP = R, o,
        # gate_up and down_proj of the layers on this GPU's pipeline stage, and QKV too with one kv head per rank
        # (Megatron groups QKV per kv head, so a rank's [q; k; v] may also be one run elsewhere); the rest goes
        # through the staging arena and the scratch buffer, which hold less than the FP8 tensors' windows in the
        # trainer's dtype.
        matched = r["tp"] == r["R"]
        linear = [n for n in r["direct"] if not n.endswith("qkv_proj.weight")]
        assert len(linear) == (3 * 2 // r["pp"] if matched else 0), r
        if matched:
            assert len(r["direct"]) - len(linear) == (2 // r["pp"] if r["tp"] == 2 else 0), r
        assert r["staging_bytes"] < r["window_bytes"] and (r["staging_bytes"] > 0) == (len(r["direct"]) < 8), r
    _same_steps_on_every_rank(rows)
    print(json.dumps(sorted({(r["tp"], r["pp"], r["R"], r["staging_bytes"], r["window_bytes"]) for r in rows})))


def _same_steps_on_every_rank(rows: list[dict]) -> None:
    by_layout: dict[tuple[int, int, int], list[list[list[int]]]] = {}
    for r in rows:
        by_layout.setdefault((r["tp"], r["pp"], r["R"]), []).append(r["step_buckets"])
    for layout, steps in by_layout.items():
        assert all(s == steps[0] for s in steps), (layout, steps)


@pytest.mark.parametrize(("tp", "pp", "dp", "R"), [(1, 2, 1, 2), (1, 2, 1, 1), (2, 1, 1, 1), (1, 2, 2, 2),
                                                   (2, 2, 1, 4)])
@pytest.mark.parametrize("landing", [2, 4])
def test_every_gpu_runs_the_same_in_engine_fp8_steps(aligned, tp, pp, dp, R, landing):
    """In-engine FP8 (SGLang's hand-over), every GPU's Resharder from one plan, on CPU: the engine's copy between two
    steps waits for every GPU of the engine (GroupEngine.deliver's barriers), so every GPU must run the same steps with
    the same buckets' transfers. Cut by each GPU's own FP8 output, trainer PP2 into engine TP2 gave one GPU more steps
    than the other, which waited at the barrier for bytes the other sent only after it: a hang. Each bucket runs once,
    in order; each FP8 tensor is quantized once, right after its last bucket; a step's output fits the landing limit
    (``landing`` buckets) unless it is one tensor larger than that."""
    spec = load_spec(aligned)
    plan = make_plan(spec, ParallelDims(tp=tp, pp=pp, dp=dp), R, element_size=2, bucket_bytes=48 * 1024,
                     weight_dtype="fp8")
    limit = landing * plan.bucket_bytes
    sides = [Resharder(plan, g, {t.src_name: torch.zeros(plan.src_shapes[t.src_name], dtype=torch.bfloat16)
                                 for b in plan.buckets for t in b if t.src_rank == g}, None, in_engine=True,
                       landing_bytes=limit, dtype=torch.bfloat16) for g in range(plan.num_gpus)]
    buckets = [[[k for op, k in ops if op == "io"] for ops in side._steps] for side in sides]
    assert all(b == buckets[0] for b in buckets), [[len(step) for step in b] for b in buckets]
    assert [k for step in buckets[0] for k in step] == list(range(len(plan.buckets)))
    assert len({side.num_rounds for side in sides}) == 1 and sides[0].num_rounds >= len(sides[0].rounds) > 1
    for g, side in enumerate(sides):
        last = {t.dst_name: k for k, b in enumerate(plan.buckets) for t in b if t.dst_rank == g}
        quantized, k = [], -1
        for ops in side._steps:
            names = []
            for op, arg in ops:
                if op == "io":
                    k = arg
                else:
                    assert last[arg] == k, (g, arg)
                    names.append(arg)
            ends = [side._fp8_out[n][1] + 4 * math.prod(side.fp8[n].scale_shape) for n in names]
            assert len(names) == 1 or max(ends, default=0) <= limit, (g, names, ends)
            quantized += names
        assert sorted(quantized) == sorted(side.fp8), g


@pytest.mark.slow
def test_two_processes_run_the_in_engine_fp8_steps_together(tmp_path, aligned):
    """Two gloo processes, meeting before and after every step's engine copy as GroupEngine.deliver does: trainer PP2
    into engine TP2 and TP1, and trainer TP2 into TP1. The hand-over ends (it hung with steps cut by each GPU's own
    output), both ran the same buckets in every step, and the engine's FP8 weights and scales equal the direct refit's,
    fp8's quantization and the float64 reference's, bit for bit, and verify."""
    rows = run_worker("reshard_fp8.py", tmp_path, aligned, 128, "1,2,2", "1,2,1", "2,1,1", nproc=2)
    assert sorted((r["tp"], r["pp"], r["R"], r["rank"]) for r in rows) == [
        (1, 2, 1, 0), (1, 2, 1, 1), (1, 2, 2, 0), (1, 2, 2, 1), (2, 1, 1, 0), (2, 1, 1, 1)]
    for r in rows:
        assert r["wrong"] == [] and r["wrong_ref"] == [] and r["in_engine"] and r["in_engine_steps"] > 1, r
    _same_steps_on_every_rank(rows)


def test_check_run_refuses_fp8_before_any_worker(tmp_path):
    """The start-up check (megarl.loop.bootstrap.check_run) runs the refusals: vLLM and a block other than 128 or 64
    in the config, the tiny recipe's model (64 k/v rows) for its shapes in blocks of 128, suggesting 64."""
    from helpers import REPO
    from megarl.loop.bootstrap import check_run

    recipe = str(REPO / "recipes/tiny_cpu_grpo.yaml")
    common = [f"checkpoint.dir={tmp_path}", "rollout.weight_dtype=fp8"]
    with pytest.raises(FieldError, match=r"rollout.weight_dtype` \(--set rollout.weight_dtype=fp8\) = \"fp8\", but it "
                                         r"must be bf16 with rollout.engine = vllm"):
        check_run(recipe, common, world=1, ranks_per_node=None, gpu_bytes=0)
    with pytest.raises(FieldError, match=r"rollout.fp8_block` \(--set rollout.fp8_block=96\) = 96, but it must be "
                                         r"128 or 64"):
        check_run(recipe, [*common, "rollout.engine=sglang", "rollout.fp8_block=96"], world=1, ranks_per_node=None,
                  gpu_bytes=0)
    with pytest.raises(UserError, match=r"rollout.weight_dtype = fp8 with rollout.tensor_parallel = 1: the engines' "
                                        r"FP8 loaders \(rollout.fp8_block = 128: 128 x 128 blocks\) refuse this "
                                        r"model's shapes: .* Use rollout.fp8_block: 64, or rollout.weight_dtype: bf16"):
        check_run(recipe, [*common, "rollout.engine=sglang"], world=1, ranks_per_node=None, gpu_bytes=0)


@pytest.mark.parametrize("block", [128, 64])
@pytest.mark.parametrize("landing", [0, 128 * 1024])
def test_memory_plan_counts_the_engines_fp8_parameters_and_the_quantization_buffers(aligned, landing, block):
    """The memory plan's FP8 figures (megarl.memory.plan.fp8_handover) against what the hand-over allocates: the
    engine's parameters as engine_tensor_allocations makes them (FP8 weights, float32 scales of rollout.fp8_block's
    blocks, the rest bf16), and the trainer's staging arena, scratch buffer and fp8_out as an in-engine Resharder
    sizes them (at most the plan's, and not more than one landing limit above it)."""
    from megarl.config import build_config
    from megarl.memory.plan import fp8_handover
    from megarl.reshard.executor import fp8_buffer_bytes

    spec = load_spec(aligned)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    plan = make_plan(spec, dims, 1, element_size=2, bucket_bytes=64 * 1024, weight_dtype="fp8", fp8_block=block)
    dst = engine_tensor_allocations(plan, 0, torch.bfloat16, torch.device("cpu"))
    hf = {n: t.to(torch.bfloat16) for n, t in load_hf(str(aligned)).items()}
    src = trainer_shards(spec, dims, 0, hf, torch.bfloat16, plan.padded_vocab)
    side = Resharder(plan, 0, src, None, in_engine=True, landing_bytes=landing)
    allocated = side.staging_bytes + side._fp8_out_bytes
    bound = fp8_buffer_bytes(plan, 0, landing)
    assert allocated <= bound <= allocated + max(landing, 1024 * 256)
    cfg = build_config({"model": {"hf_path": str(aligned)}, "data": {"train_path": "gsm8k"}},
                       ["rollout.engine=sglang", "rollout.weight_dtype=fp8", "rollout.reshard_bucket_mb=1",
                        f"rollout.landing_buffer_mb={max(1, landing // 2**20)}", f"rollout.fp8_block={block}",
                        "algorithm.rollout_correction=token_tis"])
    counted = fp8_handover(cfg, spec, dims, 2)
    assert counted is not None
    assert counted.engine_bytes == sum(t.numel() * t.element_size() for t in dst.values())
    assert counted.engine_bytes < 0.75 * sum(math.prod(s) * 2 for s in plan.engine_shapes(0).values())
    assert counted.buffer_bytes == fp8_buffer_bytes(make_plan(spec, dims, 1, element_size=2, bucket_bytes=2**20,
                                                              weight_dtype="fp8", fp8_block=block), 0, 2**20) > 0


@pytest.mark.parametrize("offload", [True, False])
def test_the_memory_plan_keeps_the_fp8_buffers_through_generation_where_the_actors_weights_stay(aligned, offload):
    """The staging arena, scratch and fp8_out are freed after the engine's copy (Resharder.release) only where the
    actor's weights leave (actor.offload_weights); kept, they stay bound through generation, and the engine, which
    sizes itself next to the generate phase, must leave room for them."""
    from megarl.config import build_config
    from megarl.memory.plan import fp8_handover, plan_memory

    spec = load_spec(aligned)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    cfg = build_config({"model": {"hf_path": str(aligned)}, "data": {"train_path": "gsm8k"}},
                       ["rollout.engine=sglang", "rollout.weight_dtype=fp8", f"actor.offload_weights={offload}",
                        "algorithm.rollout_correction=token_tis"])
    fp8 = fp8_handover(cfg, spec, dims, 2)
    assert fp8 is not None and fp8.buffer_bytes > 0
    plan = plan_memory(cfg, spec, dims, 80 * 2**30)
    assert plan.phases["handover"]["FP8 quantization buffers"] == fp8.buffer_bytes
    kept = {phase for phase, parts in plan.phases.items() if "FP8 quantization buffers" in parts}
    assert kept == ({"handover"} if offload else set(plan.phases)), kept


def test_the_memory_plan_counts_fp8_where_a_trainer_rank_holds_less_than_an_engine(aligned):
    """Trainer TP1 over two data-parallel ranks under one rollout TP2 engine: no trainer rank holds a whole engine
    rank, so the FP8 figures come from a plan over both replicas (they used to be dropped, the engine's weights then
    counted in bf16 and no quantization buffers at all)."""
    from megarl.config import build_config
    from megarl.memory.plan import fp8_handover
    from megarl.reshard.executor import fp8_buffer_bytes

    spec = load_spec(aligned)
    cfg = build_config({"model": {"hf_path": str(aligned)}, "data": {"train_path": "gsm8k"}},
                       ["rollout.engine=sglang", "rollout.weight_dtype=fp8", "rollout.tensor_parallel=2",
                        "algorithm.rollout_correction=token_tis"])
    counted = fp8_handover(cfg, spec, ParallelDims(tp=1, pp=1, dp=2), 2)
    assert counted is not None
    plan = make_plan(spec, ParallelDims(tp=1, pp=1, dp=2), 2, element_size=2, bucket_bytes=2**20, weight_dtype="fp8")
    dst = [engine_tensor_allocations(plan, g, torch.bfloat16, torch.device("cpu")) for g in range(2)]
    assert counted.engine_bytes == max(sum(t.numel() * t.element_size() for t in d.values()) for d in dst)
    assert counted.buffer_bytes == max(fp8_buffer_bytes(plan, g, 0) for g in range(2)) > 0
    assert fp8_handover(cfg, spec, ParallelDims(tp=1, pp=1, dp=3), 2) is None  # no whole engine: refused at start-up

