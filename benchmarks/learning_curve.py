"""Held-out accuracy curves of training runs, with a two-proportion test of the first against the best eval.

  python benchmarks/learning_curve.py NAME=RUN/metrics.jsonl [NAME=...] --png OUT.png [--json OUT.json]
      [--samples-per-step K] [--reach SET=ACC]

With --samples-per-step the x axis is samples consumed (steps x K) instead of steps; --reach reports, per run, the
first eval at or above ACC on SET (the samples, or steps, it took).

Reads the eval rows megarl writes into metrics.jsonl (``eval/<set>/initial/accuracy`` before the first step,
``eval/<set>/accuracy`` after a step) and each set's size from ``--n SET=N``. The test is the pooled two-sided
z-test of two proportions, each eval scoring N prompts greedily once: first against last (``p_first_vs_last``, the
comparison fixed in advance) and first against the best (``p_first_vs_best``, times the number of later evals,
Bonferroni's bound: picking the best of several evals makes its plain p-value too small).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from megarl.report import phase_median, ran_phases


def curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    """{set: [(steps trained, accuracy), ...]}; the initial eval counts as 0 steps, the eval after step s as s + 1."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            parts = key.split("/")
            if parts[0] != "eval" or parts[-1] != "accuracy":
                continue
            trained = 0 if parts[2] == "initial" else int(row["step"]) + 1
            out.setdefault(parts[1], []).append((trained, float(value)))
    return {name: sorted(points) for name, points in out.items()}


def two_proportion_p(p1: float, p2: float, n: int) -> float:
    """Two-sided p-value that two proportions, each from n trials, are equal (pooled z-test)."""
    pooled = (p1 + p2) / 2
    se = math.sqrt(2 * pooled * (1 - pooled) / n)
    if se == 0:
        return 1.0
    return math.erfc(abs(p2 - p1) / se / math.sqrt(2))


def phase_medians(path: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()][1:]  # step 0 compiles and captures
    # as megarl.report: phases that did work (a GRPO run's critic took microseconds), each over the steps that did it
    medians = {k: phase_median(rows, k) for k in ran_phases(rows)}
    medians["tokens_per_s"] = statistics.median([r["tokens_per_s"] for r in rows if "tokens_per_s" in r] or [0.0])
    return {k: round(v, 3) for k, v in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="NAME=PATH of a run's metrics.jsonl")
    parser.add_argument("--n", action="append", default=[], help="SET=N: prompts in an eval set")
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--samples-per-step", type=int, help="x axis in samples consumed: steps x this")
    parser.add_argument("--reach", help="SET=ACC: the first eval of each run at or above ACC on SET")
    args = parser.parse_args()
    scale = args.samples_per_step or 1
    reach_set, reach_acc = (args.reach.split("=", 1)[0], float(args.reach.split("=", 1)[1])) if args.reach \
        else (None, 0.0)
    sizes = {k: int(v) for k, v in (item.split("=", 1) for item in args.n)}
    runs = {name: Path(path) for name, path in (item.split("=", 1) for item in args.runs)}
    report: dict[str, dict] = {}
    for name, path in runs.items():
        report[name] = {"metrics": str(path), "phase_medians": phase_medians(path), "sets": {}}
        for eval_set, points in curves(path).items():
            first, best = points[0][1], max(acc for _, acc in points)
            entry = {"curve": points, "first": first, "best": best, "last": points[-1][1]}
            if eval_set in sizes:
                n, later = sizes[eval_set], max(len(points) - 1, 1)
                entry |= {"n": n, "p_first_vs_last": two_proportion_p(first, points[-1][1], n),
                          "p_first_vs_best": min(1.0, later * two_proportion_p(first, best, n))}
            if eval_set == reach_set:
                entry["reached"] = next((trained * scale for trained, acc in points if acc >= reach_acc), None)
            report[name]["sets"][eval_set] = entry
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    eval_sets = sorted({s for r in report.values() for s in r["sets"]})
    fig, axes = plt.subplots(1, len(eval_sets), figsize=(5 * len(eval_sets), 3.6), squeeze=False)
    for ax, eval_set in zip(axes[0], eval_sets, strict=True):
        for name, entry in report.items():
            if eval_set in entry["sets"]:
                steps, acc = zip(*entry["sets"][eval_set]["curve"], strict=True)
                ax.plot([s * scale for s in steps], acc, marker="o", label=name)
        if eval_set == reach_set:
            ax.axhline(reach_acc, color="grey", linestyle=":", linewidth=1)
        top = max(acc for r in report.values() if eval_set in r["sets"] for _, acc in r["sets"][eval_set]["curve"])
        ax.set(title=f"held-out {eval_set}, greedy", ylabel="accuracy", ylim=(0, min(1.0, 1.2 * top + 0.02)),
               xlabel="samples consumed" if args.samples_per_step else "RL steps trained")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
