"""How fast megarl._C.fp8_block_quantize turns a bf16 weight into block-wise FP8, against torch doing the same.

  python benchmarks/fp8_quant_rate.py [--rows 14336] [--cols 4096] [--count 8] [--json OUT]

Weights of Llama-3-8B's MLP shape (default: 8 of [14336, 4096], 0.9 GiB of bf16), quantized whole by the kernel and,
in the same run, by torch's ops (per-block amax by a reshape, the scale, the division and the cast: what an engine
computes when it quantizes a bf16 checkpoint on load). The kernel reads 2 bytes and writes 1 per element, so its
bound is 3 bytes per element at the device's bandwidth. The kernel's result is compared with torch's at a correctly
rounded scale (the scales equal; values may differ by one FP8 step at ties, megarl/reshard/fp8_reference.py) and
with the engines' own rule (torch's amax / 448.0, a reciprocal multiplication on a GPU: some scales differ in their
last bit).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checksum_rate import timed  # noqa: E402

from megarl.reshard import fp8  # noqa: E402
from megarl.reshard.fp8_reference import AMAX_FLOOR, BLOCK, E4M3_MAX  # noqa: E402


def torch_quantize(w: torch.Tensor, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 of a 2-D weight whose sides are multiples of BLOCK, in torch's ops. As an engine writes it
    (``exact`` False), amax / 448 divides by a Python number, which torch does on a GPU as a multiplication by the
    float32 reciprocal; ``exact`` divides by a tensor, correctly rounded, as the reference defines the scale."""
    rows, cols = w.shape
    blocks = w.float().view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    divisor = torch.tensor(E4M3_MAX, device=w.device) if exact else E4M3_MAX
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR) / divisor
    values = (blocks / scale).to(torch.float8_e4m3fn).view(rows, cols)
    return values, scale.view(rows // BLOCK, cols // BLOCK)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=14336)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weights = [torch.randn(args.rows, args.cols, dtype=torch.bfloat16, device=device) for _ in range(args.count)]
    outs = [torch.empty(args.rows, args.cols, dtype=torch.float8_e4m3fn, device=device) for _ in weights]
    scales = [torch.empty(args.rows // BLOCK, args.cols // BLOCK, dtype=torch.float32, device=device)
              for _ in weights]

    def kernel() -> None:
        for w, o, s in zip(weights, outs, scales, strict=True):
            fp8.quantize(w, out=o, scales=s)

    kernel_s = timed(kernel, device, args.repeats)
    torch_s = timed(lambda: [torch_quantize(w) for w in weights], device, args.repeats)
    exact_values, exact_scales = torch_quantize(weights[0], exact=True)
    engine_values, engine_scales = torch_quantize(weights[0])
    same_scales = bool(torch.equal(exact_scales, scales[0]))
    differ = (exact_values.float() != outs[0].float()).float().mean().item()
    engine_scales_differ = (engine_scales != scales[0]).float().mean().item()
    engine_differ = (engine_values.float() != outs[0].float()).float().mean().item()
    elements = args.count * args.rows * args.cols
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "shape": [args.count, args.rows, args.cols], "bf16_gib": elements * 2 / 2**30,
              "kernel_ms": kernel_s * 1e3, "kernel_gbps": elements * 3 / kernel_s / 1e9, "torch_ms": torch_s * 1e3,
              "torch_over_kernel": torch_s / kernel_s, "scales_equal_exact_torch": same_scales,
              "values_differing_from_exact_torch": differ, "scales_differing_from_engine_rule": engine_scales_differ,
              "values_differing_from_engine_rule": engine_differ}
    print(f"fp8 block quantization of {result['bf16_gib']:.2f} GiB bf16 on {result['device']}: kernel "
          f"{result['kernel_ms']:.2f} ms ({result['kernel_gbps']:.0f} GB/s read+write), torch "
          f"{result['torch_ms']:.2f} ms ({result['torch_over_kernel']:.2f}x the kernel); against torch with a "
          f"correctly rounded scale: scales equal {same_scales}, values differing {differ:.2e} (ties); against the "
          f"engines' amax / 448.0: scales differing {engine_scales_differ:.2e}, values {engine_differ:.2e}",
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
