"""What SGLang's own decode log says about a run: its decode steps' batch sizes, tokens/s and GPU occupancy.

  python benchmarks/sglang_decode_log.py LOG [--full 0.9] [--json OUT]

Reads the scheduler's ``Decode batch`` lines (one every ``decode_log_interval`` steps, 40 by default): the running
requests, the KV tokens in use, whether the step ran as a CUDA graph, the tokens/s since the last line and, with
``SGLANG_ENABLE_METRICS_DEVICE_TIMER=1``, ``fwd occupancy``: the share of that wall time the GPU spent in the
forward passes (the rest is the scheduler, sampling's host side, and the request/response path). Prints one JSON
object: the line count, and over the lines whose batch is at least ``--full`` of the largest (the full-batch
steady state) the median batch, KV tokens, tokens/s, step milliseconds (batch / tokens/s), occupancy and the share
of lines that ran as a graph; the same over all lines.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

FIELDS = {"running": r"#running-req: (\d+)", "kv_tokens": r"#token: (\d+)",
          "graph": r"cuda graph: (True|False)", "tokens_per_s": r"gen throughput \(token/s\): ([\d.]+)",
          "occupancy": r"fwd occupancy: ([\d.]+|nan)%"}


def parse(lines: list[str]) -> list[dict[str, float]]:
    out = []
    for line in lines:
        if "Decode batch" not in line:
            continue
        row: dict[str, float] = {}
        for key, pattern in FIELDS.items():
            m = re.search(pattern, line)
            if m:
                row[key] = 1.0 if m.group(1) == "True" else 0.0 if m.group(1) == "False" else float(m.group(1))
        if "running" in row and row.get("tokens_per_s"):
            out.append(row)
    return out


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    def med(key: str) -> float | None:
        values = [r[key] for r in rows if key in r and r[key] == r[key]]
        return round(statistics.median(values), 2) if values else None

    steps = [r["running"] / r["tokens_per_s"] * 1e3 for r in rows]
    return {"lines": len(rows), "batch": med("running"), "kv_tokens": med("kv_tokens"),
            "tokens_per_s": med("tokens_per_s"), "step_ms": round(statistics.median(steps), 3) if steps else None,
            "occupancy_pct": med("occupancy"), "graph_share": med("graph")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--full", type=float, default=0.9)
    parser.add_argument("--json")
    args = parser.parse_args()
    with open(args.log, errors="replace") as f:
        rows = parse(f.readlines())
    top = max((r["running"] for r in rows), default=0)
    result = {"full_batch": summary([r for r in rows if r["running"] >= args.full * top]), "all": summary(rows)}
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
