"""SGLang on one GPU, for real: generation, a weight update through the resharder, sleep/wake, and
the whole hand-over time (resharder + SGLang ingest) against SGLang's stock HF-tensor update.

  python benchmarks/sglang_refit.py --work /tmp/sgl --json OUT.json

1. A tiny Qwen2 engine starts on weights A; greedy output equals transformers' (A).
2. Megatron-layout shards of weights B -> resharder -> engine layout -> update_weights; greedy
   output now equals transformers' (B). sleep/wake keeps it.
3. A Llama-3-8B-shaped engine (load_format="dummy") times the full hand-over over warm refits:
   megarl (refit into engine layout + direct ingest) vs stock (full HF tensors, SGLang slices).
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
    args = p.parse_args()
    work = Path(args.work)

    result: dict = {}
    if not args.skip_tiny:
        tiny_checks(work, result)
    big_benchmark(work, result, args)


def tiny_checks(work: Path, result: dict) -> None:
    from helpers import make_hf_model
    from megarl.models.spec import load_spec
    from megarl.parallel import ParallelDims
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
    engine = SGLangEngine(str(a), gpu_memory_fraction=0.2, disable_cuda_graph=True, attention_backend="triton",
                          sampling_backend="pytorch", grammar_backend="none")
    result["tiny_start_s"] = time.perf_counter() - t0
    ref_a, ref_b = greedy_hf(a, prompts, 12), greedy_hf(b, prompts, 12)
    got_a = [c.token_ids for c in engine.generate(prompts, greedy)]
    result["greedy_equals_hf_A"] = got_a == ref_a
    spec = load_spec(b)
    plan = make_plan(spec, ParallelDims(tp=1, pp=1, dp=1), 1, element_size=2)
    dst = engine_tensor_allocations(plan, 0, torch.bfloat16, torch.device("cuda"))
    resharder = Resharder(plan, 0, megatron_shards(b, plan), dst)
    resharder.refit()
    engine.update_weights(dst)
    got_b = [c.token_ids for c in engine.generate(prompts, greedy)]
    result |= {"greedy_equals_hf_B_after_update": got_b == ref_b, "B_differs_from_A": ref_a != ref_b}
    engine.sleep()  # releases weights and KV cache: the trainer pushes weights again after wake
    engine.wake()
    resharder.refit()
    engine.update_weights(dst)
    result["greedy_after_sleep_wake_update"] = [c.token_ids for c in engine.generate(prompts, greedy)] == ref_b
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0))
    result["sampled_logprobs_ok"] = all(len(c.logprobs) == len(c.token_ids) for c in sampled)
    print(json.dumps(result), flush=True)
    engine.shutdown()
    del engine, resharder, dst
    torch.cuda.empty_cache()


def big_benchmark(work: Path, result: dict, args: argparse.Namespace) -> None:
    from megarl.models.presets import PRESETS
    from megarl.models.spec import load_spec
    from megarl.parallel import ParallelDims
    from megarl.reshard.executor import Resharder, engine_tensor_allocations
    from megarl.reshard.planner import make_plan
    from megarl.rollout.sglang import SGLangEngine

    big = work / "llama3-8b"
    big.mkdir(parents=True, exist_ok=True)
    (big / "config.json").write_text(json.dumps(PRESETS["llama3-8b"] | {"torch_dtype": "bfloat16",
                                                                         "max_position_embeddings": 4096}))
    spec = load_spec(big)
    t0 = time.perf_counter()
    engine = SGLangEngine(str(big), gpu_memory_fraction=0.3, load_format="dummy", disable_cuda_graph=True,
                          attention_backend="triton", sampling_backend="pytorch", grammar_backend="none")
    result["8b_start_s"] = time.perf_counter() - t0
    plan = make_plan(spec, ParallelDims(tp=1, pp=1, dp=1), 1, element_size=2)
    src = {n: torch.randn(s, device="cuda", dtype=torch.bfloat16) for n, s in plan.src_shapes.items()}
    dst = engine_tensor_allocations(plan, 0, torch.bfloat16, torch.device("cuda"))
    resharder = Resharder(plan, 0, src, dst)

    def ours() -> None:
        resharder.refit()
        engine.update_weights(dst)
        torch.cuda.synchronize()

    from megarl.models.mapping import param_rules, to_hf

    def stock() -> None:
        # What verl/slime hand SGLang on one GPU: full HF tensors, SGLang's load_weights slices them.
        tensors = []
        for rule in param_rules(spec):
            tensors += list(to_hf(rule, spec, [src[rule.mcore]]).items())
        engine.engine.update_weights_from_tensor(tensors, load_format=None, flush_cache=True)
        torch.cuda.synchronize()

    for name, fn in (("megarl", ours), ("stock", stock)):
        fn()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        result[f"8b_{name}_p50_ms"] = percentile(times, 50)
        result[f"8b_{name}_ms"] = times
    refit_only = []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        resharder.refit()
        torch.cuda.synchronize()
        refit_only.append((time.perf_counter() - t0) * 1e3)
    result["8b_refit_only_p50_ms"] = percentile(refit_only, 50)
    result["8b_speedup_vs_stock"] = result["8b_stock_p50_ms"] / result["8b_megarl_p50_ms"]
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    engine.shutdown()


if __name__ == "__main__":
    main()
