"""The block-wise FP8 weight format, defined in float64: the independent reference the kernels are tested against.

The format is the one SGLang's and vLLM's FP8 loaders read for ``quantization_config.weight_block_size: [b, b]``
(b = 128 in DeepSeek-V3's checkpoints, the default; 64 with rollout.fp8_block: 64): a linear layer's weight [out, in]
as ``float8_e4m3fn`` plus ``weight_scale_inv``, float32 [ceil(out / b), ceil(in / b)], one scale per b x b block, the
last row and column of blocks partial where out or in is not a multiple of b. ``weight_scale_inv`` is the
dequantization multiplier, despite its name: the engine computes with ``w[i, j] ~= fp8[i, j] * weight_scale_inv[i //
b, j // b]``.

One block's quantization, everything exact or rounded once:

- amax = max |x| over the block (exact in any precision); a NaN or an infinity counts as +inf.
- scale = float32(max(amax, float32(1e-4)) / 448), rounded to nearest even from the exact quotient. The floor of
  1e-4 is SGLang's ``per_block_cast_to_fp8`` (``amax.clamp(1e-4)``), so an all-zero block gets scale
  float32(1e-4) / 448 and quantizes to zeros; 448 is e4m3fn's largest finite value.
- q = e4m3fn(x / scale), x / scale exact (float64 holds it closely enough that rounding it first changes nothing:
  a bf16 or float32 x over a float32 scale is never within 2^-29 relative of an e4m3 tie without being one) and
  rounded to nearest, ties to even, onto e4m3fn's values. Since scale >= amax / 448 * (1 - 2^-24), |x / scale| <=
  448 * (1 + 2^-23) < 464, which rounds to 448: a finite block never leaves the range. A block with a NaN or an
  infinity gets scale +inf: its finite elements become zeros (sign kept) and the others NaN (e4m3fn has no
  infinity; NaN is 0x7F), so the block dequantizes to NaN and the hand-over's logprob check sees it.

e4m3fn rounding (``round_e4m3``): normals 2^e * (1 + m / 8) for e in [-6, 8] (m <= 6 at e = 8: 448), subnormals
m * 2^-9. Magnitudes from 448 up round to 448 ("satfinite", CUDA's __NV_SATFINITE: 464 is the tie between 448 and
480, which is not a value, and goes to the even 448; all above it, infinities too, saturate); NaN stays NaN. torch
2.13's ``.to(torch.float8_e4m3fn)`` on CPU rounds the same way, saturation included (tests/test_fp8_quant.py pins
it); the quantizer never reaches past 448 anyway.

How it differs from the engines' own quantizers: SGLang's ``per_block_cast_to_fp8`` and slime's Triton kernel
compute q = fp8(x * (448 / amax)) or fp8(x * (1 / scale)) in float32, rounding the multiplier and the product
first; their scales equal these, and their values differ from these (the correctly rounded ones) by one e4m3 step
for the rare elements near a tie. Blackwell's DeepGEMM path rounds scales up to powers of two (UE8M0); this is the
Hopper format, float32 scales.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128
"""Rows and columns of a quantization block by default (``weight_block_size: [128, 128]``; rollout.fp8_block)."""
E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value."""
AMAX_FLOOR = float(torch.tensor(1e-4, dtype=torch.float32))
"""The smallest amax a scale is computed from (SGLang's clamp(1e-4), in float32), so a zero block has scale > 0."""


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 ``v`` rounded to nearest (ties to even) onto float8_e4m3fn's values, saturating at +-448; float64.

    Exact: ``v`` is scaled by powers of two only, and ``torch.round`` rounds half to even.
    """
    v = v.to(torch.float64)
    a = v.abs()
    # Exponent of the binade, floored at the smallest normal's (-6): below it the step is the subnormals' 2^-9.
    _, exponent = torch.frexp(a)  # a = f * 2^exponent, f in [0.5, 1)
    e = torch.clamp(exponent.to(torch.float64) - 1, min=-6.0)
    step = torch.pow(2.0, e - 3)
    r = torch.round(a / step) * step
    r = torch.where(a >= E4M3_MAX, torch.full_like(a, E4M3_MAX), r)
    r = torch.where(torch.isnan(a), a, r)
    return torch.copysign(r, v)


def block_scales(x: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """float32 [ceil(rows / br), ceil(cols / bc)]: each block's scale (the module's docstring) from 2-D ``x``."""
    br, bc = block
    rows, cols = x.shape
    a = x.to(torch.float64).abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, math.inf), a)
    out = torch.empty(_ceil(rows, br), _ceil(cols, bc), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            amax = float(a[i * br:(i + 1) * br, j * bc:(j + 1) * bc].max())
            out[i, j] = max(amax, AMAX_FLOOR) / E4M3_MAX
    # float64 -> float32 rounds to nearest even; amax / 448 is never near a float32 tie (module docstring).
    return out.to(torch.float32)


def quantize(x: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``x`` (any float dtype) block-quantized: (float8_e4m3fn values of x's shape, float32 scales)."""
    if x.dim() != 2:
        raise ValueError(f"quantize: the weight must be 2-D [out, in], not of shape {tuple(x.shape)}")
    br, bc = block
    scales = block_scales(x, block)
    expanded = scales.to(torch.float64).repeat_interleave(br, 0)[: x.shape[0]]
    expanded = expanded.repeat_interleave(bc, 1)[:, : x.shape[1]]
    q = round_e4m3(x.to(torch.float64) / expanded)
    q = torch.where(torch.isnan(q), torch.full_like(q, math.nan), q)  # one NaN, 0x7F, whatever inf / inf's sign
    # Every value of q is exactly an e4m3fn value (or NaN): the conversion below only encodes it.
    return q.to(torch.float8_e4m3fn), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """float64 q * scale of its block: what the engine computes with."""
    br, bc = block
    expanded = scales.to(torch.float64).repeat_interleave(br, 0)[: q.shape[0]]
    expanded = expanded.repeat_interleave(bc, 1)[:, : q.shape[1]]
    return q.to(torch.float64) * expanded


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
