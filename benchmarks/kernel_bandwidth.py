"""Bandwidth of megarl._C's segment copy (pack, column slice, head regroup) against torch's copy.

  python benchmarks/kernel_bandwidth.py [--json OUT]

Bandwidth counts bytes read plus written. Each case runs the same bytes through torch
(copy_/cat) in the same process, so the ratio is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import percentile, time_ms  # noqa: E402

from megarl.reshard.kernels import Segment, make_segment_copy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = 1 if dev.type == "cuda" else 16  # CPU: smaller cases
    u8 = lambda n: torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)  # noqa: E731
    cases = []

    n = (1 << 30) // scale
    s, d = u8(n), torch.empty(n, dtype=torch.uint8, device=dev)
    cases.append(("contiguous 1 GiB", [s], [d], [Segment(0, 0, 0, 0, 0, 0, 1, n)], lambda: d.copy_(s)))

    size = (4 << 20) // scale
    ts = [u8(size) for _ in range(256)]
    flat = torch.empty(256 * size, dtype=torch.uint8, device=dev)
    cases.append(("pack 256 tensors", ts, [flat], [Segment(i, 0, 0, 0, i * size, 0, 1, size) for i in range(256)],
                  lambda: torch.cat(ts, out=flat)))

    rows = 16384 // scale
    m = torch.randn(rows, 16384, dtype=torch.bfloat16, device=dev)
    cols = torch.empty(rows, 4096, dtype=torch.bfloat16, device=dev)
    cases.append(("column slice (row-parallel unpack)", [m], [cols],
                  [Segment(0, 2048 * 2, 16384 * 2, 0, 0, 4096 * 2, rows, 4096 * 2)],
                  lambda: cols.copy_(m[:, 2048:6144])))

    # Megatron QKV [group][q..., k, v] -> engine [q; k; v]: one segment per head block.
    groups, qpg, d_head, hidden = 8, 4, 128, 4096
    w = torch.randn(groups * (qpg + 2) * d_head, hidden, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(w)
    blk = d_head * hidden * 2
    segs = []
    for g in range(groups):
        base = g * (qpg + 2) * blk
        segs.append(Segment(0, base, 0, 0, g * qpg * blk, 0, 1, qpg * blk))
        segs.append(Segment(0, base + qpg * blk, 0, 0, (groups * qpg + g) * blk, 0, 1, blk))
        segs.append(Segment(0, base + (qpg + 1) * blk, 0, 0, (groups * (qpg + 1) + g) * blk, 0, 1, blk))
    wv = w.view(groups, qpg + 2, d_head, hidden)
    ov = out.view(groups * (qpg + 2), d_head, hidden)

    def torch_regroup() -> None:
        ov[: groups * qpg].view(groups, qpg, d_head, hidden).copy_(wv[:, :qpg])
        ov[groups * qpg: groups * (qpg + 1)].copy_(wv[:, qpg])
        ov[groups * (qpg + 1):].copy_(wv[:, qpg + 1])

    cases.append(("QKV regroup (llama3-8b layer)", [w], [out], segs, torch_regroup))

    results = []
    for name, srcs, dsts, segments, reference in cases:
        copy = make_segment_copy(srcs, dsts, segments)
        for _ in range(3):
            copy.run()
            reference()
        ours = percentile([time_ms(copy.run, dev, barrier=False) for _ in range(20)], 50)
        theirs = percentile([time_ms(reference, dev, barrier=False) for _ in range(20)], 50)
        nbytes = copy.total_bytes
        results.append({"case": name, "bytes": nbytes, "segments": len(segments), "megarl_ms": ours,
                        "torch_ms": theirs, "megarl_GBps": 2 * nbytes / ours / 1e6,
                        "torch_GBps": 2 * nbytes / theirs / 1e6})
    print(f"{'case':<36}{'MiB':>8}{'segs':>6}{'megarl GB/s':>13}{'torch GB/s':>12}{'ratio':>7}  ({dev})")
    for r in results:
        print(f"{r['case']:<36}{r['bytes'] / 2**20:>8.0f}{r['segments']:>6}{r['megarl_GBps']:>13.0f}"
              f"{r['torch_GBps']:>12.0f}{r['megarl_GBps'] / r['torch_GBps']:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(dev), "results": results}, indent=2))


if __name__ == "__main__":
    main()
