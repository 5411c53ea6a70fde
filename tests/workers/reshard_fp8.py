"""Multi-rank worker for test_fp8_handover.py: an FP8 hand-over (rollout.weight_dtype = fp8) from Megatron shards.

torchrun --nproc-per-node 4 tests/workers/reshard_fp8.py OUT_DIR MODEL_DIR BLOCK [TP,PP,R ...]
In blocks of BLOCK x BLOCK (rollout.fp8_block), for trainer layouts TP1, TP2, PP2 and TP2 x PP2 (DP over the rest of the
ranks) and rollout TP R in {1, 2, 4}, or the layouts given: the trainer's bf16 shards (read from HF through the mapping)
refit into engine tensors as SGLang holds them (float8_e4m3fn `...weight` and float32 `...weight_scale_inv` for the
linear layers, bf16 for the rest), filled with NaN first so an unwritten byte shows. Each FP8 weight and scale must
equal, bit for bit, megarl.reshard.fp8's quantization of the full bf16 HF weight sliced to the engine rank (qkv_shard,
gate_up_shard, shard along dim 1) and the float64 reference's; the rest must equal the engine's slicing of HF. Then the
hand-over's checksums: the engine's report verifies; a flipped FP8 byte, a flipped scale bit and a plausible wrong
quantization (scales from amax / 240) are each named. The in-engine hand-over (the trainer quantizes, the engine copies
bytes) gives the engine the same bytes and verifies, every rank meeting the others before and after each step's engine
copy as GroupEngine.deliver does (ranks whose steps differ hang there, until the short timeout of the group). A second
refit of doubled weights doubles every scale and keeps the values.
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402
from engine_reference import EngineModel, Reports, load_hf, reference_engine, trainer_shards  # noqa: E402

from megarl.distributed.parallel import ParallelDims, init_distributed  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.reshard import fp8, fp8_reference  # noqa: E402
from megarl.reshard.executor import Resharder, engine_tensor_allocations  # noqa: E402
from megarl.reshard.handover import HandoverState, apply_message  # noqa: E402
from megarl.reshard.planner import make_plan  # noqa: E402
from megarl.reshard.verify import mismatched  # noqa: E402

BF16 = torch.bfloat16


def expected_fp8(hf: dict, cfg: dict, R: int, r: int, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Engine rank r's FP8 weights and scales in blocks of n from the full bf16 HF weights (megarl.reshard.fp8's
    shards)."""
    d, block = cfg["head_dim"], (n, n)
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k, v = (hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
        out[p + "self_attn.qkv_proj.weight"] = fp8.qkv_shard(q, k, v, r, R, d, block=block)
        out[p + "self_attn.o_proj.weight"] = fp8.shard(hf[p + "self_attn.o_proj.weight"], r, R, 1, block=block)
        out[p + "mlp.gate_up_proj.weight"] = fp8.gate_up_shard(hf[p + "mlp.gate_proj.weight"],
                                                               hf[p + "mlp.up_proj.weight"], r, R, block=block)
        out[p + "mlp.down_proj.weight"] = fp8.shard(hf[p + "mlp.down_proj.weight"], r, R, 1, block=block)
    return out


def reference_fp8(hf: dict, cfg: dict, R: int, r: int, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The same from the float64 reference: each full weight quantized whole, then sliced as the engine slices."""
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    (q0, q1), (k0, k1) = fp8.qkv_rows(nh, nkv, d, r, R)
    out = {}

    def rows(name: str, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        w, s = fp8_reference.quantize(hf[name], (n, n))
        return w[a:b], s[a // n:-(-b // n)]

    def cols(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        w, s = fp8_reference.quantize(hf[name], (n, n))
        a, b = fp8.tp_range(w.shape[1], r, R)
        return w[:, a:b], s[:, a // n:-(-b // n)]

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        parts = [rows(p + "self_attn.q_proj.weight", q0, q1), rows(p + "self_attn.k_proj.weight", k0, k1),
                 rows(p + "self_attn.v_proj.weight", k0, k1)]
        out[p + "self_attn.qkv_proj.weight"] = (torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts]))
        inter = cfg["intermediate_size"] // R
        parts = [rows(p + f"mlp.{x}_proj.weight", r * inter, (r + 1) * inter) for x in ("gate", "up")]
        out[p + "mlp.gate_up_proj.weight"] = (torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts]))
        out[p + "self_attn.o_proj.weight"] = cols(p + "self_attn.o_proj.weight")
        out[p + "mlp.down_proj.weight"] = cols(p + "mlp.down_proj.weight")
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def nan_filled(plan, rank: int) -> dict[str, torch.Tensor]:
    dst = engine_tensor_allocations(plan, rank, BF16, torch.device("cpu"))
    for t in dst.values():
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)  # e4m3fn's NaN
        else:
            t.fill_(float("nan"))
    return dst


def check_layout(spec, hf: dict, cfg: dict, dims: ParallelDims, R: int, block: int) -> dict:
    rank = dist.get_rank()
    plan = make_plan(spec, dims, R, gpus_per_node=2, element_size=2, bucket_bytes=48 * 1024, weight_dtype="fp8",
                     fp8_block=block)
    r = plan.engine_rank(rank)
    src = trainer_shards(spec, dims, rank, hf, BF16, plan.padded_vocab)
    dst = nan_filled(plan, rank)
    resharder = Resharder(plan, rank, src, dst)
    resharder.refit()
    want, ref = expected_fp8(hf, cfg, R, r, block), reference_fp8(hf, cfg, R, r, block)
    plain = {n: t.to(BF16) for n, t in reference_engine(hf, cfg, R, r).items() if n not in want}
    names = {n for n in dst if not n.endswith("_scale_inv")}
    wrong = [n for n in want if not (same_bits(dst[n], want[n][0]) and same_bits(dst[n + "_scale_inv"], want[n][1]))]
    wrong_ref = [n for n in ref if not (same_bits(dst[n], ref[n][0]) and same_bits(dst[n + "_scale_inv"], ref[n][1]))]
    wrong += [n for n in plain if not same_bits(dst[n], plain[n])]
    # Checksums: the engine's report against the trainer's expectation, from the reference quantization.
    reports = Reports(resharder.checksum_names, dst)
    resharder.verify(reports, 0)
    # The in-engine hand-over (SGLang's): the trainer quantizes into its fp8_out step by step and the engine's copy
    # moves the bytes; its parameters must equal the direct refit's, and verify.
    side = Resharder(plan, rank, src, None, in_engine=True, landing_bytes=2 * plan.bucket_bytes, dtype=BF16)
    params = nan_filled(plan, rank)
    state, model = HandoverState(), EngineModel(params)
    state.handle(model, side.engine_copy().to_wire("actor"))
    for step in range(side.num_rounds):
        side.refit(step)
        dist.barrier()
        state.handle(model, apply_message("actor", torch.zeros(1), step))
        dist.barrier()
    in_engine = sorted(params) == sorted(dst) and all(same_bits(params[n], dst[n]) for n in dst)
    side.verify(Reports(side.checksum_names, params), 0)
    expected = resharder.expected_checksums()
    caught = {}
    layer = "model.layers.1." if dims.pp == 1 else "model.layers.0."
    for what, name, damage in (
            ("fp8_byte", layer + "self_attn.qkv_proj.weight", lambda t: t.view(torch.uint8)[-1, 3].add_(1)),
            ("scale_bit", layer + "mlp.down_proj.weight_scale_inv", lambda t: t.view(torch.int32)[0, -1].__ixor__(1))):
        kept = dst[name].clone()
        damage(dst[name])
        caught[what] = mismatched(reports.names, expected, reports.checksums(len(reports.names))) == [name]
        dst[name].copy_(kept)
    # A quantization of the right shapes by another rule (scales from amax / 240, as e4m3fnuz would): both named.
    victim = layer + "mlp.gate_up_proj.weight"
    kept_w, kept_s = dst[victim].clone(), dst[victim + "_scale_inv"].clone()
    wrong_s = kept_s * (448 / 240)
    expanded = wrong_s.to(torch.float64).repeat_interleave(block, 0)[:kept_w.shape[0]].repeat_interleave(block, 1)
    dst[victim].copy_((fp8_reference.dequantize(kept_w, kept_s, (block, block))
                       / expanded[:, :kept_w.shape[1]]).to(kept_w.dtype))
    dst[victim + "_scale_inv"].copy_(wrong_s)
    caught["wrong_quantization"] = mismatched(reports.names, expected, reports.checksums(len(reports.names))) == [
        victim, victim + "_scale_inv"]
    dst[victim].copy_(kept_w)
    dst[victim + "_scale_inv"].copy_(kept_s)
    # A second refit of doubled weights (bf16 doubling is exact): the scales double, the values stay.
    for t in src.values():
        t.mul_(2)
    resharder.refit()
    doubled = all(same_bits(dst[n], want[n][0]) and torch.equal(dst[n + "_scale_inv"], want[n][1] * 2) for n in want)
    for t in src.values():
        t.div_(2)
    window_bytes = sum(g.shape[0] * g.shape[1] * 2 for g in plan.fp8_tensors(rank).values())
    return {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "R": R, "block": block, "rank": rank, "engine_rank": r,
            "fp8": sorted(want), "names": sorted(names), "wrong": wrong, "wrong_ref": wrong_ref,
            "dtypes": sorted({str(t.dtype) for t in dst.values()}), "caught": caught, "doubled": doubled,
            "checksums": len(resharder.checksum_names), "direct": sorted(resharder._direct),
            "in_engine": in_engine, "in_engine_steps": side.num_rounds, "fp8_out_bytes": side._fp8_out_bytes,
            "step_buckets": [[arg for op, arg in ops if op == "io"] for ops in side._steps],
            "staging_bytes": resharder.staging_bytes, "window_bytes": window_bytes}


def main() -> None:
    out_dir, model_dir, block = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    init_distributed(platform, timeout_minutes=2)
    spec = load_spec(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hf = {n: t.to(BF16) for n, t in load_hf(model_dir).items()}
    # Blocks of very different magnitudes: every linear weight's rows scaled by powers of two.
    g = torch.Generator().manual_seed(3)
    for n in sorted(hf):
        if n.endswith("proj.weight"):
            hf[n] = hf[n] * torch.exp2(torch.randint(-12, 6, (hf[n].shape[0], 1), generator=g)).to(BF16)
    layouts = [tuple(map(int, a.split(","))) for a in sys.argv[4:]] or [
        (tp, pp, R) for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)) for R in (1, 2, 4)]
    world = dist.get_world_size()
    rows = [check_layout(spec, hf, cfg, ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp)), R, block)
            for tp, pp, R in layouts]
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
