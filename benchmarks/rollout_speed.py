"""Generation through megarl's engine adapter against the same engine driven alone, same prompts and sampling.

  python benchmarks/rollout_speed.py --model HF_DIR --data NAME_OR_PATH [--prompt-template T] [--prompts 64]
      [--samples 8] [--max-new-tokens 256] [--engine sglang|vllm] [--engine-arg KEY=VALUE ...] [--repeats 3]
      [--variants bare,adapter,...] [--json OUT] [--profile DIR [--profile-steps 20]]

Variants, run in turn on one engine (alternating, ``--repeats`` times each; the first pass of all is a warm-up):
  bare              the engine's own API: one request per prompt asking for n samples, no logprobs, no seeds
  bare+logprobs     the same, with the sampled tokens' logprobs returned
  bare-n1           the engine's own API with the adapter's request shape: prompts x n requests of one sample each,
                    no logprobs, no seeds
  bare-n1+logprobs  the same, with logprobs
  adapter           megarl's adapter as training calls it (logprobs, a seed per sample, stop at EOS)
  adapter-noseed    the adapter without seeds
``--variants`` picks some (default: bare, bare+logprobs, adapter, adapter-noseed). Prints one JSON object: the
engine's start-up seconds and, per variant, the median seconds, generated tokens and tokens/s, and its slowdown
against the first variant (its tokens/s over the variant's: sampled lengths differ from pass to pass). The prompts
are built as training builds them (chat template, data.prompt_template).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--prompt-template")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--engine", choices=["sglang", "vllm"])
    parser.add_argument("--engine-arg", action="append", default=[], help="KEY=VALUE (a YAML value) for the engine")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="bare,bare+logprobs,adapter,adapter-noseed",
                        help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--json")
    parser.add_argument("--profile", metavar="DIR", help="SGLang: after the timed passes, one more pass of the first "
                        "variant with SGLang's profiler tracing its first --profile-steps decode steps (GPU activity) "
                        "into DIR (benchmarks/decode_trace_summary.py reads the DECODE trace)")
    parser.add_argument("--profile-steps", type=int, default=20)
    return parser.parse_args()


VARIANTS = ("bare", "bare+logprobs", "bare-n1", "bare-n1+logprobs", "adapter", "adapter-noseed")


def bare_sglang(engine: Any, prompts: list[list[int]], n: int, max_new: int, temperature: float, stop: list[int],
                logprobs: bool, per_sample: bool = False) -> int:
    if per_sample:  # the adapter's request shape: one request per sample
        prompts, n = [p for p in prompts for _ in range(n)], 1
    params = {"n": n, "temperature": temperature, "max_new_tokens": max_new, "stop_token_ids": stop}
    out = engine.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=logprobs)
    return sum(len(o["output_ids"]) for o in out)


def bare_vllm(engine: Any, prompts: list[list[int]], n: int, max_new: int, temperature: float, stop: list[int],
              logprobs: bool, per_sample: bool = False) -> int:
    from vllm import SamplingParams, TokensPrompt

    if per_sample:  # the adapter's request shape: one request per sample
        prompts, n = [p for p in prompts for _ in range(n)], 1
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_new, stop_token_ids=stop,
                            logprobs=0 if logprobs else None, detokenize=False)
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return sum(len(s.token_ids) for o in out for s in o.outputs)


def main() -> None:
    args = parse_args()
    import torch
    import yaml

    from megarl.data.batching import tokenize_prompts
    from megarl.data.prompts import load_prompts
    from megarl.data.tokenizer import load_tokenizer
    from megarl.models.spec import load_spec
    from megarl.rollout.base import SamplingParams

    tokenizer = load_tokenizer(args.model, "--model")
    records = load_prompts(args.data, "question", "answer", args.prompt_template, "--data")[:args.prompts]
    prompts, _ = tokenize_prompts(records, tokenizer, True, 1024, source=repr(args.data), system_prompt=None)
    tokens = [list(p.tokens) for p in prompts]
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    kind = args.engine or ("sglang" if torch.cuda.is_available() else "vllm")
    extra = {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    max_len = min(max(map(len, tokens)) + args.max_new_tokens, load_spec(args.model).max_position_embeddings)
    engine: Any
    started = time.perf_counter()
    if kind == "sglang":
        from megarl.rollout.sglang import SGLangEngine

        engine = SGLangEngine(args.model, gpu_memory_fraction=args.gpu_memory_fraction, max_model_len=max_len,
                              enable_sleep=False, **extra)
        bare = bare_sglang
    else:
        from megarl.rollout.vllm import VLLMEngine

        engine = VLLMEngine(args.model, gpu_memory_fraction=args.gpu_memory_fraction, max_model_len=max_len,
                            enable_sleep=False, **extra)
        bare = bare_vllm
    start_s = time.perf_counter() - started
    print(f"[rollout_speed] engine started in {start_s:.1f} s", flush=True)
    info = {}
    if kind == "sglang":  # what the engine made of its arguments
        try:
            server = engine.engine.get_server_info()
        except Exception as err:  # noqa: BLE001 - a report, not a check
            server = {"get_server_info": repr(err)}
        keys = ("get_server_info", "max_total_num_tokens", "max_running_requests", "chunked_prefill_size",
                "attention_backend", "sampling_backend", "disable_overlap_schedule", "disable_radix_cache",
                "cuda_graph_config", "cuda_graph_max_bs_decode", "mem_fraction_static")
        info = {k: server[k] for k in keys if k in server}
        info = json.loads(json.dumps(info, default=str))
        print(f"[rollout_speed] engine: {info}", flush=True)
    n, m, t = args.samples, args.max_new_tokens, args.temperature

    def adapter(seed: int | None) -> int:
        params = SamplingParams(n=n, temperature=t, max_new_tokens=m, stop_token_ids=stop, seed=seed)
        return sum(len(c.token_ids) for c in engine.generate(tokens, params))

    every = {"bare": lambda: bare(engine, tokens, n, m, t, stop, False),
             "bare+logprobs": lambda: bare(engine, tokens, n, m, t, stop, True),
             "bare-n1": lambda: bare(engine, tokens, n, m, t, stop, False, per_sample=True),
             "bare-n1+logprobs": lambda: bare(engine, tokens, n, m, t, stop, True, per_sample=True),
             "adapter": lambda: adapter(1234), "adapter-noseed": lambda: adapter(None)}
    chosen = args.variants.split(",")
    unknown = [v for v in chosen if v not in every]
    assert not unknown, f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}"
    variants = {name: every[name] for name in chosen}
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in variants}
    try:
        for rep in range(args.repeats + 1):
            for name, run in variants.items():
                start = time.perf_counter()
                generated = run()
                if rep:  # the first pass warms caches, compiles and captures
                    runs[name].append((time.perf_counter() - start, generated))
                print(f"[rollout_speed] pass {rep} {name}: {time.perf_counter() - start:.2f} s, {generated} tokens",
                      flush=True)
        if args.profile and kind == "sglang":
            engine.engine.start_profile(output_dir=args.profile, num_steps=args.profile_steps, profile_by_stage=True,
                                        activities=["GPU"])
            variants[chosen[0]]()
            traces = sorted(str(p) for p in Path(args.profile).glob("*.trace.json.gz"))
            print(f"[rollout_speed] profiled pass of {chosen[0]}: {', '.join(traces) or 'no trace written'}",
                  flush=True)
    finally:
        engine.shutdown()
    def rate(times: list[tuple[float, int]]) -> float:
        return sum(g for _, g in times) / sum(s for s, _ in times)

    first = chosen[0]
    result: dict[str, Any] = {"engine": kind, "model": args.model, "data": args.data, "prompts": len(tokens),
                              "samples": n, "max_new_tokens": m, "engine_args": extra, "start_s": round(start_s, 1),
                              "engine_info": info, "variants": {}}
    for name, times in runs.items():
        if not times:  # --repeats 0: a warm-up alone (compiles and caches kernels)
            continue
        seconds = statistics.median(s for s, _ in times)
        generated = statistics.median(g for _, g in times)
        result["variants"][name] = {"seconds": round(seconds, 3), "tokens": generated,
                                    "tokens_per_s": round(rate(times)),
                                    f"slowdown_vs_{first}": round(rate(runs[first]) / rate(times), 3),
                                    "passes": [[round(s, 3), g] for s, g in times]}
    print(json.dumps(result, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
