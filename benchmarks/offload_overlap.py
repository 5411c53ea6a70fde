"""Offload transfer time: one model's state to host memory and another's back, one direction after the other
(ModelResidency.offload, then onload) against both directions at once (Residency.hold), same process.

  python benchmarks/offload_overlap.py [--gib 8] [--json OUT]

Each model holds GIB of fp32 tensors of 64 MiB (sizes like Adam's per-parameter state). Prints GB/s of each
way and their ratio; the bound is PCIe's bandwidth per direction.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from types import SimpleNamespace

import torch

from megarl.memory.offload import Residency


def model(gib: float) -> SimpleNamespace:
    count = int(gib * 16)
    params = [torch.nn.Parameter(torch.randn(16 * 2**20, device="cuda")) for _ in range(count)]
    chunk = torch.nn.ParameterList(params)
    return SimpleNamespace(chunks=[chunk], models=[chunk], optimizer=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    a, b = model(args.gib), model(args.gib)
    nbytes = 2 * args.gib * 2**30  # moved per swap: one model out, one in
    weights = {"weights"}
    residency = Residency({"a": a, "b": b}, {"a": weights, "b": weights})
    residency.hold({"a": weights})  # pins the host buffers once
    residency.hold({"b": weights})
    states = residency.states
    results = {}
    for way in ("one direction at a time", "both directions at once"):
        times = []
        for i in range(2 * args.iters):
            there, here = ("a", "b") if i % 2 == 0 else ("b", "a")
            torch.cuda.synchronize()
            start = time.perf_counter()
            if way == "both directions at once":
                residency.hold({there: weights})
            else:
                states[here].offload(weights)
                states[there].onload(weights)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        best = min(times)
        results[way] = {"seconds": best, "gb_per_s": nbytes / best / 1e9}
        print(f"{way}: {best * 1e3:.0f} ms per swap of {nbytes / 2**30:.0f} GiB, {nbytes / best / 1e9:.1f} GB/s",
              flush=True)
    ratio = results["one direction at a time"]["seconds"] / results["both directions at once"]["seconds"]
    print(f"overlap speed-up: {ratio:.2f}x", flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "device": torch.cuda.get_device_name(), "gib_per_model": args.gib,
                       "results": results, "speedup": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
