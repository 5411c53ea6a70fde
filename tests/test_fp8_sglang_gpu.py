"""rollout.weight_dtype = fp8 on a GPU with SGLang 0.5.17: the engine started in block FP8
(megarl.rollout.sglang_fp8), the project's in-engine hand-over of bf16 weights quantized into it (a TP1 trainer's
tensors, as tests/test_fp8_handover.py's one-rank test, through the real engine's attach / apply / checksums), then
(a) every engine parameter, FP8 weights and scales included, equals megarl's float64 reference quantization bit for
bit (the engine's own checksums against the reference's, and the project's verify), (b) greedy generation gives finite
logprobs near a bf16 engine's on the same prompts, (c) SGLang's own block-FP8 dequantization and its Triton GEMM read
the hand-over's weights as the reference does.

In blocks of 128 and of 64 (rollout.fp8_block; both run on an H100, benchmarks/results/h100/gpu_round_a4c7be3).
The model: MEGARL_TEST_HF_MODEL where its shapes fit the block at TP 1 (``fp8.layout_problems``; SmolLM2-135M fits
64, not 128: 576 q rows, 192 k/v rows), else a random Llama of 128-row heads in bfloat16. Engines with the triton
attention backend and torch sampling, as tests/test_rollout_sglang_gpu.py's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import make_hf_model
from megarl.distributed.parallel import ParallelDims
from megarl.models.spec import load_spec
from megarl.reshard import fp8, fp8_reference
from megarl.reshard.executor import Resharder
from megarl.reshard.handover import checksum_message
from megarl.reshard.planner import make_plan
from megarl.reshard.verify import tensor_checksum
from megarl.rollout.base import SamplingParams

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from engine_reference import load_hf, trainer_shards  # noqa: E402

pytestmark = pytest.mark.gpu

ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
               num_hidden_layers=2)
PROMPTS = [[3, 17, 42, 8, 120, 11], [100, 5, 9, 77, 31, 2, 54], [64, 64, 1, 19], [7, 7, 7, 150, 2]]
ENGINE = dict(gpu_memory_fraction=0.25, enable_sleep=False, max_model_len=256, attention_backend="triton",
              sampling_backend="pytorch", grammar_backend="none")


@pytest.fixture(scope="module", params=[128, 64])
def model_and_block(request, tmp_path_factory) -> tuple[str, int]:
    block = request.param
    path = os.environ.get("MEGARL_TEST_HF_MODEL")
    if path and not fp8.layout_problems(load_spec(path), 1, block):
        return path, block
    if path:
        print(f"\nMEGARL_TEST_HF_MODEL {path} has no FP8 layout in blocks of {block} at TP 1 "
              f"({fp8.layout_problems(load_spec(path), 1, block)}); using a random Llama of 128-row heads")
    return str(make_hf_model(tmp_path_factory.mktemp("m") / "llama", "llama", dtype=torch.bfloat16, **ALIGNED)), block


def _checksums(engine, key: str, count: int) -> torch.Tensor:
    result = torch.full((count, 2), -1, dtype=torch.int64, device="cuda")
    engine.checksums([engine.package(checksum_message(key, result))])
    return result.cpu()


class _Reports:
    """The engine as Resharder.verify asks it (megarl.rollout.group's checksums, one engine rank)."""

    def __init__(self, engine, key: str) -> None:
        self.engine, self.key = engine, key

    def checksums(self, count: int) -> torch.Tensor:
        return _checksums(self.engine, self.key, count)


def test_fp8_engine_takes_the_hand_over_and_generates(model_and_block, tmp_path):
    pytest.importorskip("sglang")
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant, triton_w8a8_block_fp8_linear

    from megarl.rollout.sglang import SGLangEngine

    model_dir, block = model_and_block
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    bf16 = SGLangEngine(model_dir, log_file=tmp_path / "bf16.log", **ENGINE)
    try:
        want = bf16.generate(PROMPTS, greedy)
    finally:
        bf16.shutdown()

    spec = load_spec(model_dir)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    plan = make_plan(spec, dims, 1, element_size=2, weight_dtype="fp8", fp8_block=block)
    hf = {n: t.to(torch.bfloat16).cuda() for n, t in load_hf(model_dir).items()}
    src = {n: t.cuda().contiguous() for n, t in trainer_shards(spec, dims, 0, hf, torch.bfloat16,
                                                               plan.padded_vocab).items()}
    engine = SGLangEngine(model_dir, log_file=tmp_path / "fp8.log", weight_dtype="fp8", fp8_block=block, **ENGINE)
    try:
        model_path = Path(engine._fp8_dir.path)
        config = json.loads((model_path / "config.json").read_text())
        assert config["quantization_config"]["weight_block_size"] == [block, block]
        side = Resharder(plan, 0, src, None, in_engine=True, landing_bytes=0)
        copy = side.engine_copy()
        engine.attach([engine.package(copy.to_wire("actor"))], "actor")
        for r in range(side.num_rounds):  # the first hand-over fills every parameter, before any generation
            side.refit(r)
            engine.apply(r)

        # (a) Bit for bit: the engine's checksums of its FP8 weights and scales against the float64 reference's
        # quantization of the full bf16 weights (TP1: the engine rank's window is the whole weight) ...
        names = side.checksum_names
        got = _checksums(engine, "actor", len(names))
        quantized = {}
        for name, geometry in plan.fp8_tensors(0).items():
            weight = torch.empty(geometry.shape, dtype=torch.float8_e4m3fn)
            scales = torch.empty(geometry.scale_shape, dtype=torch.float32)
            for part in geometry.parts:
                w, s = fp8_reference.quantize(hf[part.hf][part.rows[0]:part.rows[1], part.cols[0]:part.cols[1]].cpu(),
                                              geometry.block)
                weight[part.dst_row:part.dst_row + part.num_rows] = w
                scales[part.scale_row:part.scale_row + s.shape[0]] = s
            quantized[name], quantized[geometry.scale_name] = weight, scales
        assert len(quantized) == 8 * spec.num_layers
        for i, name in enumerate(names):
            if name in quantized:
                assert torch.equal(got[i], tensor_checksum(quantized[name], name)), name
        # ... and the project's own check of every parameter (rollout.verify_every), FP8 or not.
        side.verify(_Reports(engine, "actor"), 0)

        # (b) Greedy generation from the FP8 weights: finite logprobs, near the bf16 engine's where the tokens agree.
        out = engine.generate(PROMPTS, greedy)
        gaps = []
        for a, b in zip(out, want, strict=True):
            assert len(a.logprobs) == len(a.token_ids) > 0
            assert all(torch.isfinite(torch.tensor(a.logprobs)))
            n = min(len(a.token_ids), len(b.token_ids))
            common = next((k for k in range(n) if a.token_ids[k] != b.token_ids[k]), n)
            gaps += [abs(a.logprobs[k] - b.logprobs[k]) for k in range(common)]
        mean_gap = sum(gaps) / len(gaps)
        same = sum(a.token_ids == b.token_ids for a, b in zip(out, want, strict=True))
        print(f"\nFP8 ({block} x {block} blocks) vs bf16 greedy logprobs: mean gap {mean_gap:.4f} nats, max "
              f"{max(gaps):.4f}, over {len(gaps)} tokens of a common prefix; tokens equal in {same} of {len(out)} "
              "samples")
        # The weights' quantization alone, on an H100: mean 0.046 for the random model of 128-row heads in blocks of
        # 128, 0.140 for SmolLM2-135M in blocks of 64 (benchmarks/results/h100/gpu_round_a4c7be3); misplaced weights
        # or scales give nats.
        assert gaps and mean_gap < 0.25

        # (c) SGLang's own reading of the hand-over's format: its block dequantization equals the reference's, and
        # its Triton block-FP8 GEMM (the runner megarl pins) matches x @ dequantized.T up to the activations' own
        # FP8 quantization.
        name = "model.layers.0.mlp.down_proj.weight"
        w, s = quantized[name].cuda(), quantized[name + "_scale_inv"].cuda()
        ours = fp8_reference.dequantize(quantized[name], quantized[name + "_scale_inv"], (block, block))
        ours = ours.to(torch.float32)
        assert torch.equal(block_quant_dequant(w, s, [block, block], torch.float32).cpu(), ours)
        x = torch.randn(8, w.shape[1], dtype=torch.bfloat16, device="cuda")
        y = triton_w8a8_block_fp8_linear(x, w, [block, block], s).float()
        ref = x.float() @ ours.cuda().T
        rel = ((y - ref).norm() / ref.norm()).item()
        print(f"SGLang's Triton block-FP8 GEMM vs x @ dequantized.T: relative error {rel:.4f}")
        assert rel < 0.05
    finally:
        engine.shutdown()
    assert not model_path.exists()  # the config override directory goes with the engine
