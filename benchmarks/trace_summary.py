"""Where a profiled step's time went, per phase: `train.py --profile STEP` writes the trace this reads.

  python benchmarks/trace_summary.py RUN/profile_stepSTEP_rank0.json

For each phase of the step (train.py's phases, named phase/NAME in the trace): its wall time, the time this
process's GPU work ran in it (the union of its kernels and copies, so overlapping ones count once), that as a share
of the wall time, and the kernels launched; then, per phase, the host calls that took longest in all (CUDA runtime
calls such as cudaMalloc or a synchronisation, and torch operators, which nest: an operator's time includes its
callees'). A phase whose GPU share is low waits on the host: Python, launches, synchronisation, compilation, or
another thread holding the interpreter. Only this process's GPU work is in the trace, not a colocated engine's.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import Counter
from pathlib import Path


def busy(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Microseconds of [lo, hi] covered by the union of ``intervals`` (sorted by start)."""
    total, end = 0.0, lo
    for a, b in intervals:
        if a >= hi:
            break
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def summarize(trace: dict) -> list[dict]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    phases = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("phase/")]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    kernels = sorted(float(e["ts"]) for e in events if e.get("cat") == "kernel")
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op")]
    rows = []
    for p in sorted(phases, key=lambda e: float(e["ts"])):
        lo, hi = float(p["ts"]), float(p["ts"]) + float(p["dur"])
        on_gpu = busy(gpu, lo, hi)
        calls: Counter[str] = Counter()
        for e in host:
            if lo <= float(e["ts"]) < hi:
                calls[f"{e['cat']}:{e['name']}"] += float(e["dur"]) / 1e6
        rows.append({"phase": str(p["name"])[len("phase/"):], "wall_s": (hi - lo) / 1e6, "gpu_s": on_gpu / 1e6,
                     "gpu_share": on_gpu / max(hi - lo, 1e-9),
                     "kernels": bisect.bisect_left(kernels, hi) - bisect.bisect_left(kernels, lo),
                     "top": calls.most_common(8)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    args = parser.parse_args()
    rows = summarize(json.loads(args.trace.read_text()))
    print(f"{'phase':<12} {'wall s':>8} {'GPU s':>8} {'GPU share':>10} {'kernels':>8}")
    for r in rows:
        print(f"{r['phase']:<12} {r['wall_s']:>8.3f} {r['gpu_s']:>8.3f} {r['gpu_share']:>10.0%} {r['kernels']:>8}")
    for r in rows:
        print(f"\n{r['phase']}: the host calls that took longest, seconds in all")
        for name, seconds in r["top"]:
            print(f"  {seconds:8.3f}  {name[:100]}")


if __name__ == "__main__":
    main()
