"""Step time, throughput and staleness of training runs, from their metrics.jsonl: the table in
benchmarks/results/h200/async_opd/README.md and docs/async.md.

  python benchmarks/step_table.py NAME=RUN/metrics.jsonl [NAME=...] [--baseline NAME] [--skip 1] [--exclude STEP]

A step's time is the sum of its phases without the evaluation (time/*, eval excluded); the first --skip steps
(CUDA graph capture, an empty pool) are left out, and any --exclude step (one traced by --profile). tokens/s is the
response tokens trained (response_length x --samples-per-step) over those steps' time; "x" is a multiple of the
baseline run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summary(path: Path, skip: int, samples: int, exclude: frozenset[int] = frozenset()) -> dict[str, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in [r for r in rows if "time/generate" in r][skip:] if r["step"] not in exclude]
    if not rows:
        raise SystemExit(f"{path}: no training steps after the first {skip}")
    times = [sum(v for k, v in r.items() if k.startswith("time/") and k != "time/eval") for r in rows]
    tokens = sum(r["response_length"] * samples for r in rows)
    return {"steps": len(rows), "mean_s": statistics.mean(times), "median_s": statistics.median(times),
            "generate_s": statistics.mean(r["time/generate"] for r in rows), "tokens_per_s": tokens / sum(times),
            "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in rows),
            "staleness_max": max(r.get("async/staleness_max", 0.0) for r in rows),
            "dropped": sum(r.get("async/dropped_stale", 0.0) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="NAME=METRICS")
    parser.add_argument("--baseline", help="the run whose tokens/s the others are a multiple of (default: the first)")
    parser.add_argument("--skip", type=int, default=1, help="first steps left out (default 1)")
    parser.add_argument("--samples-per-step", type=int, default=512, help="samples a step trains (default 512)")
    parser.add_argument("--exclude", type=int, action="append", default=[], metavar="STEP",
                        help="a step left out (a profiled one); may repeat")
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    args = parser.parse_args()
    runs = dict(run.split("=", 1) for run in args.runs)
    table = {name: summary(Path(path), args.skip, args.samples_per_step, frozenset(args.exclude))
             for name, path in runs.items()}
    base = table[args.baseline or next(iter(table))]["tokens_per_s"]
    print("| run | steps | mean step | median step | generate (mean) | tokens/s | staleness mean / max | dropped |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, s in table.items():
        print(f"| {name} | {s['steps']} | {s['mean_s']:.2f} s | {s['median_s']:.2f} s | {s['generate_s']:.2f} s | "
              f"{s['tokens_per_s']:,.0f} ({s['tokens_per_s'] / base:.2f}x) | {s['staleness_mean']:.2f} / "
              f"{s['staleness_max']:.0f} | {s['dropped']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
