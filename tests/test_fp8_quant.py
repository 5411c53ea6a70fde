"""Block-wise FP8 quantization (issue 54's format and kernel): megarl._C.fp8_block_quantize against the float64
reference megarl.reshard.fp8_reference, bit for bit; engine TP shards (megarl.reshard.fp8) against slices of the
single-rank quantization; the reference's e4m3 rounding against torch's; and the refusals of bad input."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.models.presets import preset_or_hf_spec
from megarl.reshard import fp8, fp8_reference
from megarl.reshard.engine_layout import engine_tensors
from megarl.reshard.fp8_reference import AMAX_FLOOR, E4M3_MAX, round_e4m3
from megarl.reshard.verify import tensor_checksum

_C = pytest.importorskip("megarl._C")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_same(kernel: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Values and scales equal bit for bit (NaN and -0.0 included), with the first difference named."""
    for what, got, want in (("values", *(x[0] for x in (kernel, reference))),
                            ("scales", *(x[1] for x in (kernel, reference)))):
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        diff = (bits(got) != bits(want)).nonzero()
        assert diff.numel() == 0, (f"{what} differ at {diff.shape[0]} places, first {tuple(diff[0].tolist())}: "
                                   f"{got[tuple(diff[0])].item()} != {want[tuple(diff[0])].item()}")


def kernel(x: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8.quantize(x, block=block)


def varied(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values whose magnitude varies per row and column (blocks of very different scales), with a zero
    block, a block of subnormal-sized values, one whose amax is below the 1e-4 floor, and tiny values beside
    large ones (they quantize to e4m3 subnormals)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-20, 12, (rows, 1), generator=g)).to(torch.float64)
    x *= torch.exp2(torch.randint(-4, 4, (1, cols), generator=g)).to(torch.float64)
    x[:128, :128] = 0.0
    x[128:256, :128] *= 1e-30
    if cols > 128:
        x[:128, 128:256] = torch.randn(128, min(128, cols - 128), generator=g, dtype=torch.float64) * 1e-6
    x[-3:, :] = x[-3:, :] * 1e-9
    x[-1, 0] = 1e4
    return x.to(dtype)


@pytest.mark.parametrize("block", [(128, 128), (64, 64)])  # rollout.fp8_block's choices
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(300, 260), (256, 384), (129, 1), (1, 700)])
def test_kernel_equals_the_float64_reference(dtype, shape, block):
    x = varied(*shape, dtype, seed=shape[0] + shape[1]) if min(shape) > 1 else torch.randn(*shape).to(dtype)
    assert_same(kernel(x, block), fp8_reference.quantize(x, block))


def test_every_bfloat16_value_quantizes_as_the_reference():
    """All 65536 bf16 patterns (NaN and infinities replaced), in blocks of every magnitude, and in small blocks."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(512, 128).clone()
    x[~torch.isfinite(x)] = 0
    assert_same(kernel(x), fp8_reference.quantize(x))
    assert_same(kernel(x, (4, 16)), fp8_reference.quantize(x, (4, 16)))
    # Every value over the scale 1 (a block whose amax is 448): the rounding alone, ties and subnormals included.
    small = x[(x.abs() <= 448) & (x.abs() > 0)].float()
    small = torch.cat([small, torch.zeros(-small.numel() % 127)]).reshape(-1, 127)
    y = torch.cat([small, torch.full((small.shape[0], 1), 448.0)], dim=1).to(torch.bfloat16)
    q, s = fp8.quantize(y, block=(1, 128))
    assert torch.all(s == 1.0)
    torch_q = y.float().to(torch.float8_e4m3fn)
    assert torch.equal(bits(q), bits(torch_q)), "with scale 1 the kernel rounds as torch does below 464"


def test_ties_round_to_even_and_subnormals():
    # amax 448 gives scale exactly 1, so x / scale = x: 1.0625 lies halfway between 1.0 and 1.125 (to the even 1.0),
    # 1.1875 between 1.125 and 1.25 (to 1.25); 3 * 2^-10 between the subnormals 2^-9 and 2^-8 (to 2^-8); 2^-10
    # halfway between 0 and 2^-9 (to 0); 2^-11 and -2^-11 below it (to +0 and -0).
    values = [448.0, 1.0625, 1.1875, 3 * 2**-10, 2**-10, 2**-11, -(2**-11), -1.0625, 2**-9 * 7.5, 464 / 2]
    x = torch.tensor([values], dtype=torch.bfloat16)
    q, s = kernel(x)
    assert s.item() == 1.0
    want = [448.0, 1.0, 1.25, 2**-8, 0.0, 0.0, -0.0, -1.0, 2**-6, 224.0]
    assert q.float().tolist()[0] == want
    assert bits(q)[0, 6].item() == 0x80, "-2^-11 rounds to -0"
    assert_same((q, s), fp8_reference.quantize(x))


def test_the_448_boundary():
    """No finite input leaves e4m3's range: the amax element divides to 448 * (1 + at most 2^-23), which rounds to
    448. Beyond it, magnitudes from 448 up round to 448 (satfinite): 464 is a tie between 448 and 480 (not a value)
    and goes to the even 448, and so does everything above, infinities included; torch's .to(float8_e4m3fn) on CPU
    does the same (pinned here, as the reference's docstring says)."""
    edge = torch.tensor([448.0, 448.0 * (1 + 2**-23), 463.99, 464.0, 464.01, 479.0, 480.0, 1e6, math.inf],
                        dtype=torch.float64)
    edge = torch.cat([edge, -edge])
    ours = round_e4m3(edge)
    assert ours.tolist() == [448.0] * 9 + [-448.0] * 9
    theirs = edge.to(torch.float32).to(torch.float8_e4m3fn)
    assert torch.equal(bits(theirs), bits(ours.to(torch.float8_e4m3fn))), "torch's conversion stopped saturating"
    # Amaxes whose float32 scale rounds down (amax / 448 just below the stored scale's): still 448, never NaN.
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        amax = float(torch.rand(1, generator=g) * 1000 + 1e-3)
        x = torch.tensor([[amax, -amax, amax * 0.999]], dtype=torch.float32)
        q, s = kernel(x)
        assert q.float()[0, :2].tolist() == [448.0, -448.0], (amax, s.item())
        assert_same((q, s), fp8_reference.quantize(x))


def test_scale_rules():
    x = torch.zeros(130, 3, dtype=torch.bfloat16)
    x[128:, :] = 2.0 * 448
    q, s = kernel(x)
    assert s[0, 0].item() == torch.tensor(AMAX_FLOOR / E4M3_MAX, dtype=torch.float32).item(), \
        "a zero block's scale is float32(1e-4) / 448 (SGLang's clamp)"
    assert s[1, 0].item() == 2.0
    assert torch.all(q[:128].float() == 0) and torch.all(q[128:].float() == 448.0)
    # Dequantized: q * scale gives the weight back within e4m3's relative step (2^-4) where normal.
    w = varied(256, 256, torch.bfloat16, seed=3)
    q, s = kernel(w)
    back = fp8_reference.dequantize(q, s)
    normal = w.double().abs() >= s.double().repeat_interleave(128, 0).repeat_interleave(128, 1) * 2**-6
    rel = ((back - w.double()).abs() / w.double().abs())[normal]
    assert rel.max() <= 2**-4


def test_non_finite_blocks():
    """A NaN or an infinity makes its block's scale +inf: finite elements become (signed) zeros, the others NaN."""
    x = torch.randn(4, 260, dtype=torch.float32)
    x[0, 3] = math.nan
    x[1, 200] = -math.inf
    q, s = kernel(x)
    assert s.tolist()[0] == [math.inf, math.inf, s[0, 2].item()] and math.isfinite(s[0, 2].item())
    assert bits(q)[0, 3].item() == 0x7F and bits(q)[1, 200].item() == 0x7F
    assert torch.all(q[:, :256].float().nan_to_num(0.0) == 0)
    assert_same((q, s), fp8_reference.quantize(x))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_tp_shards_are_slices_of_the_single_rank_quantization(world, dim):
    """Shards of 96 or 192 rows/columns cut 128-blocks: each rank's scales are the full weight's for every block it
    touches, computed from the whole block, so a cut block has one scale on every rank."""
    w = varied(384, 384, torch.bfloat16, seed=7)
    q_full, s_full = fp8_reference.quantize(w)
    for rank in range(world):
        q, s = fp8.shard(w, rank, world, dim)
        lo, hi = rank * 384 // world, (rank + 1) * 384 // world
        first, count = fp8.scale_span(lo, hi - lo, 128)
        want = (q_full.narrow(dim, lo, hi - lo), s_full.narrow(dim, first, count))
        assert_same((q, s), want)


def test_a_window_cutting_blocks_on_both_dims():
    w = varied(300, 260, torch.float32, seed=9)
    w[33, :] *= 1e3  # the largest elements of blocks whose first rows and columns lie outside the window
    w[:, 2] *= 1e3
    q_full, s_full = fp8_reference.quantize(w, (16, 32))
    q, s = fp8.quantize(w, rows=(37, 250), cols=(5, 199), block=(16, 32))
    assert_same((q, s), (q_full[37:250, 5:199], s_full[2:16, 0:7]))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_qkv_shards_with_gqa_replication(world):
    """8 query heads, 2 kv heads of 128: at TP 4 each kv head is on two ranks; every part is quantized on its own
    block grid (as a checkpoint stores q_proj, k_proj, v_proj), its scales stacked like its rows."""
    d, hidden = 128, 256
    g = torch.Generator().manual_seed(world)
    q, k, v = (torch.randn(n * d, hidden, generator=g).to(torch.bfloat16) * 0.02 for n in (8, 2, 2))
    refs = [fp8_reference.quantize(p) for p in (q, k, v)]
    for rank in range(world):
        got = fp8.qkv_shard(q, k, v, rank, world, d)
        nq = 8 // world
        kv = rank * 2 // world if world <= 2 else rank // (world // 2)
        nkv = 2 // world if world <= 2 else 1
        rows = [(rank * nq * d, nq * d), (kv * d, nkv * d), (kv * d, nkv * d)]
        want_q = torch.cat([r[0].narrow(0, lo, n) for r, (lo, n) in zip(refs, rows, strict=True)])
        want_s = torch.cat([r[1].narrow(0, lo // 128, n // 128) for r, (lo, n) in zip(refs, rows, strict=True)])
        assert_same(got, (want_q, want_s))


@pytest.mark.parametrize("rollout_tp", [1, 2, 4, 8])
def test_qkv_rows_follow_the_engine_layout(rollout_tp):
    spec = preset_or_hf_spec("llama3-8b", num_layers=1)
    tensors = {t.name: t for t in engine_tensors(spec, rollout_tp, rank=rollout_tp - 1)}
    pieces = tensors["model.layers.0.self_attn.qkv_proj.weight"].pieces
    (q0, q1), (kv0, kv1) = fp8.qkv_rows(spec.num_attention_heads, spec.num_kv_heads, spec.head_dim,
                                        rollout_tp - 1, rollout_tp)
    assert [(p.start, p.stop) for p in pieces] == [(q0, q1), (kv0, kv1), (kv0, kv1)]


def test_gate_up_shard_and_writing_into_engine_tensors():
    g = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(512, 256, generator=g).to(torch.bfloat16) for _ in range(2))
    refs = [fp8_reference.quantize(p) for p in (gate, up)]
    # The engine's parameters, written in place through row views.
    weight = torch.empty(512, 256, dtype=torch.float8_e4m3fn)
    scale = torch.empty(4, 2, dtype=torch.float32)
    for rank in range(2):
        q, s = fp8.merged_rows([(gate, rank * 256, rank * 256 + 256), (up, rank * 256, rank * 256 + 256)],
                               out=weight, scales=scale)
        assert q.data_ptr() == weight.data_ptr() and s.data_ptr() == scale.data_ptr()
        want = (torch.cat([r[0][rank * 256:rank * 256 + 256] for r in refs]),
                torch.cat([r[1][rank * 2:rank * 2 + 2] for r in refs]))
        assert_same((weight, scale), want)
        assert_same(fp8.gate_up_shard(gate, up, rank, 2), want)


def test_layout_problems_name_what_the_engines_refuse():
    llama = preset_or_hf_spec("llama3-8b", num_layers=1)
    assert all(fp8.layout_problems(llama, r) == [] for r in (1, 2, 4, 8))
    smol = preset_or_hf_spec("smollm2-135m", num_layers=1)
    problems = fp8.layout_problems(smol, 1)
    assert any("q_proj rows per engine rank = 576" in p for p in problems), problems
    assert fp8.layout_problems(smol, 1, 64) == []  # rollout.fp8_block: 64


def test_bad_input_is_refused_naming_the_argument():
    src = torch.zeros(16, 16, dtype=torch.bfloat16)
    out = torch.empty(16, 16, dtype=torch.float8_e4m3fn)
    scales = torch.empty(2, 2)
    quantize = _C.fp8_block_quantize
    with pytest.raises(RuntimeError, match="`source` must be bfloat16 or float32, not Half"):
        quantize(src.half(), out, scales, 0, 0, 8, 8)
    with pytest.raises(RuntimeError, match="`out` must be float8_e4m3fn"):
        quantize(src, out.view(torch.uint8), scales, 0, 0, 8, 8)
    with pytest.raises(RuntimeError, match="`scales` must be float32"):
        quantize(src, out, scales.double(), 0, 0, 8, 8)
    with pytest.raises(RuntimeError, match=r"`scales` must be \[2, 2\]"):
        quantize(src, out, torch.empty(2, 3), 0, 0, 8, 8)
    with pytest.raises(RuntimeError, match="do not fit the source's 16 columns"):
        quantize(src, out[:, :9], scales, 0, 8, 8, 8)
    with pytest.raises(RuntimeError, match="`source` must have contiguous rows"):
        quantize(src.t(), out, scales, 0, 0, 8, 8)
    with pytest.raises(RuntimeError, match="`out` must be 2-D"):
        quantize(src, out.view(-1), scales, 0, 0, 8, 8)
    with pytest.raises(RuntimeError, match=r"fp8_block_quantize\(`layers.0.qkv`\)"):
        quantize(src, out, scales, 0, 0, 0, 8, "layers.0.qkv")
    offloaded = torch.zeros(16, 16, dtype=torch.bfloat16)
    offloaded.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="`source` has no memory behind it"):
        quantize(offloaded, out, scales, 0, 0, 8, 8)
    with pytest.raises(ValueError, match="must be 2-D"):
        fp8.quantize(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=r"out has shape \(4, 4\), the window .* has \(4, 8\)"):
        fp8.quantize(torch.zeros(8, 8), rows=(0, 4), out=torch.empty(4, 4, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="not divisible by the engine's tensor parallelism 3"):
        fp8.shard(torch.zeros(16, 16), 0, 3, 0)
    with pytest.raises(ValueError, match="cannot be split over an engine TP of 3"):
        fp8.qkv_shard(torch.zeros(8 * 4, 8), torch.zeros(8, 8), torch.zeros(8, 8), 0, 3, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_cuda_kernel_equals_the_cpu_one():
    """Not yet run (written on a CPU machine): the CUDA kernel shares fp8_block_math.h's arithmetic."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(512, 128).clone()
    x[~torch.isfinite(x)] = 0
    cases = [(x, {}), (varied(300, 260, torch.bfloat16, 1), {}), (varied(384, 384, torch.float32, 2), {}),
             (varied(300, 260, torch.float32, 3), {"rows": (37, 250), "cols": (5, 199), "block": (16, 32)}),
             (varied(384, 384, torch.bfloat16, 4), {"rows": (96, 192)}),
             (varied(384, 384, torch.bfloat16, 5), {"cols": (288, 384)})]
    for source, window in cases:
        assert_same(tuple(t.cpu() for t in fp8.quantize(source.cuda(), **window)), fp8.quantize(source, **window))
    nan = torch.randn(4, 260)
    nan[0, 3], nan[1, 200] = math.nan, -math.inf
    assert_same(tuple(t.cpu() for t in fp8.quantize(nan.cuda())), fp8_reference.quantize(nan))
    with pytest.raises(RuntimeError, match="must be on one device"):
        _C.fp8_block_quantize(x.cuda(), torch.empty(512, 128, dtype=torch.float8_e4m3fn), torch.empty(4, 1))


def test_the_hand_over_checksum_covers_fp8_values_and_scales():
    """The checksum (megarl.reshard.verify) reads FP8 weights as bytes and scales as 4-byte words: a shard's
    checksum sees one e4m3 step and a scale's last bit."""
    q, s = fp8.shard(varied(256, 256, torch.bfloat16, seed=12), 1, 2, 0)
    base_q, base_s = tensor_checksum(q).tolist(), tensor_checksum(s).tolist()
    nudged = q.clone()
    nudged.view(torch.uint8)[5, 7] += 1
    assert tensor_checksum(nudged).tolist() != base_q
    bumped = s.clone()
    bumped.view(torch.int32)[0, 1] ^= 1
    assert tensor_checksum(bumped).tolist() != base_s
    assert tensor_checksum(q.clone()).tolist() == base_q
