"""SGLang on one GPU, for real: generation, weight updates through the resharder, sleep/wake, and
the whole hand-over time against SGLang's stock HF-tensor update.

  python benchmarks/sglang_refit.py --work /tmp/sgl --json OUT.json [--model PRESET --num-layers N --skip-tiny]

Keys of the big engine's results start with the preset's short name ("8b" for llama3-8b, else the preset).

1. A tiny Qwen2 engine starts on weights A; its greedy output is compared with transformers' (A),
   and where they differ, the transformers logit margin at the first differing token is recorded.
2. Megatron-layout shards of weights B -> in-engine hand-over (attach once, apply) -> greedy output
   equals transformers' (B); again after sleep/wake + apply; the direct path (resharder into
   engine-layout tensors + load_format="direct") back to A gives the engine's own output on A.
3. An engine of a preset's shape (``--model``, default Llama-3-8B; ``--num-layers`` keeps the first layers;
   load_format="dummy") times whole hand-overs over warm repeats:
   in-engine (refit + one RPC that replays one kernel in the engine), direct (refit into engine-
   layout tensors + SGLang's direct ingest), stock (full HF tensors, SGLang slices them), and an
   empty update (SGLang's RPC round trip alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]

from timing import percentile  # noqa: E402

# What runs on the staged SGLang 0.5.17 (no flash-attn, no CUDA-graph capture needed for a benchmark).
ENGINE_ARGS = dict(disable_cuda_graph=True, attention_backend="triton", sampling_backend="pytorch",
                   grammar_backend="none")


def greedy_hf(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        out.append(ids[0, len(p):].tolist())
    del hf
    return out


def megatron_shards(model_dir: Path, plan, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    from megarl.models.hf_io import HFReader
    from megarl.models.mapping import hf_shapes, param_rules, to_mcore_shard
    from megarl.models.spec import load_spec

    spec = load_spec(model_dir)
    reader = HFReader(model_dir, spec, hf_shapes(spec))
    return {r.mcore: to_mcore_shard(r, spec, reader.read, 0, 1, plan.padded_vocab).to("cuda", dtype).contiguous()
            for r in param_rules(spec)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/megarl-sgl")
    p.add_argument("--json")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--model", default="llama3-8b", help="preset of the big engine (configs/models)")
    p.add_argument("--num-layers", type=int, help="keep only the first layers of the big engine")
    p.add_argument("--fraction", type=float, default=0.3, help="the big engine's mem_fraction_static")
    args = p.parse_args()
    work = Path(args.work)

    result: dict = {}
    if not args.skip_tiny:
        tiny_checks(work, result)
    big_benchmark(work, result, args)


def tiny_checks(work: Path, result: dict) -> None:
    from helpers import make_hf_model
    from megarl.distributed.parallel import ParallelDims
    from megarl.models.spec import load_spec
    from megarl.reshard.executor import Resharder, engine_tensor_allocations
    from megarl.reshard.planner import make_plan
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.sglang import SGLangEngine

    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    a = make_hf_model(work / "a", "qwen2", seed=1, dtype=torch.bfloat16, **shape)
    b = make_hf_model(work / "b", "qwen2", seed=2, dtype=torch.bfloat16, **shape)
    prompts = [[1, 2, 3, 4, 5], [7, 100, 42], [9, 8, 7, 6, 5, 4, 3, 2]]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    t0 = time.perf_counter()
    engine = SGLangEngine(str(a), gpu_memory_fraction=0.2, dtype="bfloat16", **ENGINE_ARGS)
    result["tiny_start_s"] = time.perf_counter() - t0
    ref_a, ref_b = greedy_hf(a, prompts, 12), greedy_hf(b, prompts, 12)
    got_a = [c.token_ids for c in engine.generate(prompts, greedy)]
    result["greedy_equals_hf_A"] = got_a == ref_a
    if got_a != ref_a:
        result["A_first_divergence"] = divergence_margins(a, prompts, got_a, ref_a)
    spec = load_spec(b)
    plan = make_plan(spec, ParallelDims(tp=1, pp=1, dp=1), 1, element_size=2)
    shards_b = megatron_shards(b, plan)
    in_engine = Resharder(plan, 0, shards_b, None, in_engine=True)
    attach(engine, in_engine)
    in_engine.refit()
    engine.apply()
    got_b = [c.token_ids for c in engine.generate(prompts, greedy)]
    result |= {"greedy_equals_hf_B_after_in_engine_update": got_b == ref_b, "B_differs_from_A": ref_a != ref_b}
    engine.sleep()  # releases weights and KV cache: the trainer pushes weights again after wake
    engine.wake()
    engine.apply()
    result["greedy_B_after_sleep_wake_apply"] = [c.token_ids for c in engine.generate(prompts, greedy)] == ref_b
    dst = engine_tensor_allocations(plan, 0, torch.bfloat16, torch.device("cuda"))
    Resharder(plan, 0, megatron_shards(a, plan), dst).refit()
    engine.update_weights(dst)
    result["direct_update_back_to_A_equals_engine_on_A"] = [
        c.token_ids for c in engine.generate(prompts, greedy)] == got_a
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0))
    result["sampled_logprobs_ok"] = all(len(c.logprobs) == len(c.token_ids) for c in sampled)
    print(json.dumps(result), flush=True)
    engine.shutdown()
    del engine, in_engine, dst, shards_b
    torch.cuda.empty_cache()


def attach(engine, resharder) -> None:
    copy = resharder.engine_copy()
    engine.attach([engine.package(copy.to_wire("bench", len(copy.sources)))], "bench")


def divergence_margins(model_dir: Path, prompts: list[list[int]], got: list[list[int]], ref: list[list[int]]
                       ) -> list[dict]:
    """Where the engine's greedy tokens leave transformers': transformers' logit gap between its top two
    tokens there (bf16 near-ties flip under different kernels) and the engine token's rank."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    out = []
    for p, g, r in zip(prompts, got, ref, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(g, r, strict=False)) if x != y), None)
        if k is None:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([p + r[:k]], device="cuda")).logits[0, -1].float()
        top = logits.topk(2)
        out.append({"position": k, "hf_top2_gap": float(top.values[0] - top.values[1]),
                    "engine_token_rank": int((logits > logits[g[k]]).sum())})
    del hf
    return out


def big_benchmark(work: Path, result: dict, args: argparse.Namespace) -> None:
    from megarl.distributed.parallel import ParallelDims
    from megarl.models.presets import PRESETS
    from megarl.models.spec import load_spec
    from megarl.reshard.executor import Resharder, engine_tensor_allocations
    from megarl.reshard.planner import make_plan
    from megarl.rollout.sglang import SGLangEngine

    key = "8b" if args.model == "llama3-8b" else args.model
    big = work / args.model
    big.mkdir(parents=True, exist_ok=True)
    shape = PRESETS[args.model] | ({"num_hidden_layers": args.num_layers} if args.num_layers else {})
    (big / "config.json").write_text(json.dumps(shape | {"torch_dtype": "bfloat16", "max_position_embeddings": 4096}))
    spec = load_spec(big)
    result[f"{key}_num_layers"] = spec.num_layers
    t0 = time.perf_counter()
    engine = SGLangEngine(str(big), gpu_memory_fraction=args.fraction, load_format="dummy", dtype="bfloat16",
                          **ENGINE_ARGS)
    result[f"{key}_start_s"] = time.perf_counter() - t0
    plan = make_plan(spec, ParallelDims(tp=1, pp=1, dp=1), 1, element_size=2)
    src = {n: torch.randn(s, device="cuda", dtype=torch.bfloat16) for n, s in plan.src_shapes.items()}
    dst = engine_tensor_allocations(plan, 0, torch.bfloat16, torch.device("cuda"))
    direct = Resharder(plan, 0, src, dst)
    in_engine = Resharder(plan, 0, src, None, in_engine=True)
    t0 = time.perf_counter()
    attach(engine, in_engine)
    result[f"{key}_attach_ms"] = (time.perf_counter() - t0) * 1e3

    def ours() -> None:
        in_engine.refit()
        engine.apply()  # returns once the engine's kernel finished

    def ours_direct() -> None:
        direct.refit()
        engine.update_weights(dst)
        torch.cuda.synchronize()

    from megarl.models.mapping import hf_shapes, param_rules, to_hf

    def stock() -> None:
        # What verl/slime hand SGLang on one GPU: full HF tensors, SGLang's load_weights slices them.
        tensors = []
        shapes = hf_shapes(spec)
        for rule in param_rules(spec):
            tensors += list(to_hf(rule, spec, [src[rule.mcore]], shapes).items())
        engine.engine.update_weights_from_tensor(tensors, load_format=None, flush_cache=True)
        torch.cuda.synchronize()

    def empty() -> None:
        engine.engine.update_weights_from_tensor([], load_format="direct", flush_cache=True)

    def refit_only() -> None:
        direct.refit()
        torch.cuda.synchronize()

    for name, fn in (("megarl", ours), ("megarl_direct", ours_direct), ("stock", stock), ("empty_update", empty),
                     ("refit_only", refit_only)):
        fn()
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        result[f"{key}_{name}_p50_ms"] = percentile(times, 50)
        result[f"{key}_{name}_ms"] = times
        print(f"{key} {name}: p50 {result[f'{key}_{name}_p50_ms']:.2f} ms", flush=True)
    nbytes = sum(t.nbytes for t in dst.values())
    result[f"{key}_engine_bytes"] = nbytes
    result[f"{key}_speedup_vs_stock"] = result[f"{key}_stock_p50_ms"] / result[f"{key}_megarl_p50_ms"]
    result[f"{key}_speedup_vs_direct"] = result[f"{key}_megarl_direct_p50_ms"] / result[f"{key}_megarl_p50_ms"]
    # After the timed in-engine apply, the engine holds what the resharder computes: spot-check one tensor.
    ours()
    direct.refit()
    checks: dict[str, bool | None] = {}
    last_ffn = "mlp.experts.w2_weight" if spec.is_moe else "mlp.down_proj.weight"
    for name in ("model.norm.weight", f"model.layers.{spec.num_layers - 1}.{last_ffn}"):
        weights = engine.engine.get_weights_by_name(name, truncate_size=4)
        if weights is None:  # SGLang 0.5.17's Qwen3-MoE model cannot return its weights
            checks[name] = None
            continue
        got = torch.as_tensor(weights).float().flatten().cpu()
        checks[name] = bool(torch.equal(got, dst[name][:4].float().flatten()[: got.numel()].cpu()))
    result[f"{key}_in_engine_spot_check"] = checks
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    engine.shutdown()


if __name__ == "__main__":
    main()
