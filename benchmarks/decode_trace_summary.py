"""Where an SGLang decode step's time goes: the trace `rollout_speed.py --profile DIR` has the engine write.

  python benchmarks/decode_trace_summary.py DIR/*-DECODE.trace.json.gz [--top 15] [--json OUT]

SGLang's profiler (profile_by_stage) traces its first decode steps of a pass. A step is one CUDA-graph replay
(cudaGraphLaunch) or, without graphs, one forward; the steps' wall time runs from the first launch to the last kernel
of the last step. Against it: the time the GPU ran anything (the union of kernels, copies and sets, so overlapping
work counts once), the kernels per step, and the kernels that took longest, grouped by name, in microseconds per
step. The gap between wall and GPU time is the host's: SGLang's scheduler, sampling's host side, the request path.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path

from trace_summary import busy

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_family(name: str) -> str:
    """A kernel's name without its template arguments, argument list and return type, which differ per batch size
    and say nothing of what it does."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    kept, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            kept.append(ch)
    return "".join(kept).strip()[:90] or "?"


def summarize(trace: dict, top: int = 15) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in GPU_CATS)
    if not gpu:
        raise SystemExit("no GPU work in this trace: was it written with activities including GPU?")
    launches = sorted(float(e["ts"]) for e in events
                      if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in str(e.get("name")))
    steps = len(launches)
    lo = launches[0] if launches else gpu[0][0]
    hi = max(b for _, b in gpu)
    wall = hi - lo
    on_gpu = busy(gpu, lo, hi)
    per_kernel: Counter[str] = Counter()
    count = 0
    for e in events:
        if e.get("cat") == "kernel" and float(e["ts"]) >= lo:
            per_kernel[kernel_family(str(e["name"]))] += float(e["dur"])
            count += 1
    per = max(steps, 1)
    return {"steps": steps, "graphs": bool(launches), "wall_us_per_step": round(wall / per, 1),
            "gpu_us_per_step": round(on_gpu / per, 1), "gpu_share": round(on_gpu / max(wall, 1e-9), 3),
            "kernels_per_step": round(count / per, 1),
            "top": [{"kernel": k, "us_per_step": round(v / per, 1), "share_of_gpu": round(v / max(on_gpu, 1e-9), 3)}
                    for k, v in per_kernel.most_common(top)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    opener = gzip.open if args.trace.suffix == ".gz" else open
    with opener(args.trace, "rt") as f:
        result = summarize(json.load(f), args.top)
    what = f"{result['steps']} decode steps (CUDA graphs)" if result["graphs"] else \
        "no CUDA-graph replays in this trace: totals over it, not per step"
    print(f"{what}: {result['wall_us_per_step']} us a step, the GPU busy {result['gpu_us_per_step']} us "
          f"({result['gpu_share']:.0%}), {result['kernels_per_step']} kernels a step")
    for row in result["top"]:
        print(f"  {row['us_per_step']:8.1f} us  {row['share_of_gpu']:6.1%}  {row['kernel']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
