"""Step time, throughput and staleness of training runs, from their metrics.jsonl: the tables in
benchmarks/results/h200/async_opd/ and docs/async.md.

  python benchmarks/step_table.py NAME=RUN/metrics.jsonl [NAME=...] [--baseline NAME] [--skip 1] [--exclude STEP]

A step's time is its wall time without its held-out evaluation: time/step - time/eval, where the run logged
time/step. Older runs logged only their phases, whose sum misses what runs between them (0.3-0.7 s a step on the
H200), so for them the wall time comes from their console log, RUN.log beside the RUN directory, whose lines the
H200 scripts stamp with the seconds since launch ("[215s] step 3/12 ..."): a step's time is the stamp of its line
less the stamp of the line before (whole seconds: the mean over the steps is exact to 1 s over their span, one
step's to 1 s). The first --skip steps (CUDA graph capture, an empty pool) are left out, and any --exclude step (one
traced by --profile). tokens/s is the response tokens trained (response_length x --samples-per-step) over those
steps' time; "x" is a multiple of the baseline run's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

STAMPED_STEP = re.compile(r"^\[(\d+)s\] step (\d+)/\d+ ")


def stamped_walls(log: Path) -> dict[int, float]:
    """Step index -> wall seconds from its console line's stamp to the previous step line's (from the second on)."""
    stamps = {int(m[2]) - 1: int(m[1]) for m in map(STAMPED_STEP.match, log.read_text().splitlines()) if m}
    return {step: stamp - stamps[step - 1] for step, stamp in stamps.items() if step - 1 in stamps}


def walls(path: Path, rows: list[dict]) -> tuple[dict[int, float], str]:
    """Each step's wall time without its evaluation, and where it came from."""
    if all("time/step" in r for r in rows):
        return {r["step"]: r["time/step"] - r.get("time/eval", 0.0) for r in rows}, "time/step"
    log = path.parent.with_suffix(".log")
    if not log.is_file():
        raise SystemExit(f"{path}: its rows have no time/step (logged before it existed) and there is no console log "
                         f"{log} to take the wall time from")
    stamped = stamped_walls(log)
    missing = [r["step"] for r in rows if r["step"] not in stamped]
    if missing:
        raise SystemExit(f"{log}: no stamped console line for steps {missing} (or for the step before each)")
    return {r["step"]: stamped[r["step"]] - r.get("time/eval", 0.0) for r in rows}, "log stamps"


def summary(path: Path, skip: int, samples: int, exclude: frozenset[int] = frozenset()) -> dict[str, float | str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in [r for r in rows if "time/generate" in r][skip:] if r["step"] not in exclude]
    if not rows:
        raise SystemExit(f"{path}: no training steps after the first {skip}")
    wall, source = walls(path, rows)
    times = [wall[r["step"]] for r in rows]
    phases = [sum(v for k, v in r.items() if k.startswith("time/") and k not in ("time/eval", "time/step"))
              for r in rows]
    tokens = sum(r["response_length"] * samples for r in rows)
    return {"steps": len(rows), "mean_s": statistics.mean(times), "median_s": statistics.median(times),
            "phases_mean_s": statistics.mean(phases), "generate_s": statistics.mean(r["time/generate"] for r in rows),
            "tokens_per_s": tokens / sum(times), "phases_tokens_per_s": tokens / sum(phases), "wall_from": source,
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
    base = table[args.baseline or next(iter(table))]
    print("| run | steps | mean step (wall) | median step | generate (mean) | tokens/s | (from the phases' sum) | "
          "staleness mean / max | dropped |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, s in table.items():
        print(f"| {name} | {s['steps']} | {s['mean_s']:.2f} s | {s['median_s']:.2f} s | {s['generate_s']:.2f} s | "
              f"{s['tokens_per_s']:,.0f} ({s['tokens_per_s'] / base['tokens_per_s']:.2f}x) | "  # type: ignore[operator]
              f"{s['phases_tokens_per_s']:,.0f} ({s['phases_tokens_per_s'] / base['phases_tokens_per_s']:.2f}x) | "  # type: ignore[operator]
              f"{s['staleness_mean']:.2f} / {s['staleness_max']:.0f} | {s['dropped']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
