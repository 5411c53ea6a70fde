"""How fast the hand-over checksum (rollout.verify_every) reads a model's weights, against a plain read.

  python benchmarks/checksum_rate.py [--gib 6.5] [--dtype bfloat16] [--json OUT]

One tensor of the given size (the engine weights of Llama-3-8B's 16-layer body are 6.5 GiB), checksummed by
megarl._C.checksum (csrc/verify) and summed by torch.sum in the same run: the sum is a read-bound reduction of
the same bytes, so their ratio is the checksum's cost over reading the weights once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import percentile, sync  # noqa: E402

from megarl.reshard.verify import tensor_checksum  # noqa: E402


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return percentile(times[1:], 50)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=6.5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    numel = int(args.gib * 2**30) // torch.empty((), dtype=dtype).element_size()
    t = torch.randn(numel, dtype=dtype, device=device)
    checksum_s = timed(lambda: tensor_checksum(t), device, args.repeats)
    read_s = timed(lambda: t.sum(dtype=torch.float32), device, args.repeats)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "gib": args.gib,
              "dtype": args.dtype, "checksum_ms": checksum_s * 1e3, "checksum_gbps": t.nbytes / checksum_s / 1e9,
              "sum_ms": read_s * 1e3, "sum_gbps": t.nbytes / read_s / 1e9, "checksum_over_sum": checksum_s / read_s}
    print(f"checksum of {args.gib:g} GiB {args.dtype}: {result['checksum_ms']:.1f} ms "
          f"({result['checksum_gbps']:.1f} GB/s); torch.sum {result['sum_ms']:.1f} ms "
          f"({result['sum_gbps']:.1f} GB/s); ratio {result['checksum_over_sum']:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
