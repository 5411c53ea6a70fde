"""The local spec's fused core attention (megarl.models.attention) against attention written out in float64:
causal rows, packed rows (given as a block-causal mask or as segment ids; FlexAttention on a GPU), grouped-query
heads."""

import pytest
import torch

from megarl.models.attention import block_causal_mask


def reference(q, k, v, mask, scale):
    """[s, b, h, d] inputs; mask None (causal) or [b, 1, s, s] True = masked out. Returns [s, b, h * d]."""
    s, b, h, d = q.shape
    group = h // k.shape[2]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if mask is None:
        mask = ~torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(mask, float("-inf"))
    return (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, h * d)


@pytest.fixture(scope="module")
def attention():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.models.attention import FusedCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, attention_dropout=0.0)
    return FusedCoreAttention(config, 1, AttnMaskType.causal, "self")


# Three rows: one sequence, two packed, three packed then padding (a segment of its own).
SEGMENTS = [[0] * 12, [0] * 5 + [1] * 7, [0] * 3 + [1] * 4 + [2] * 2 + [3] * 3]

# Micro-batches after FlexAttention's warm-up (rows, segment lengths): lengths, row counts and layouts it never saw.
LATER = ((3, [300, 211, 90]), (1, [517, 20]), (4, [64] * 8), (1, [1000, 24]))


def later_segments(rows, lengths, device=None):
    """[rows, sum(lengths)] segment ids, each row the same layout."""
    return torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)]] * rows, device=device)


def layer_qkv(s, rows, dtype, device, requires_grad=False):
    """Query, key and value [s, rows, heads or groups, 64] of SmolLM2's shape (9 heads, 3 groups) made as
    Megatron's SelfAttention makes them (megatron/core/transformer/attention.py, get_query_key_value_tensors): the
    QKV linear layer's [s, rows, 960] output viewed as [s, rows, 3, 320] and split, query reshaped, then query and
    key rotated into new tensors. The warm-up makes its own (megatron_qkv); these are the ones a step passes."""
    hidden = torch.randn(s, rows, 576, device=device, dtype=dtype)
    weight = (torch.randn(960, 576, device=device, dtype=dtype) / 24).requires_grad_(requires_grad)  # unit outputs
    mixed = torch.nn.functional.linear(hidden, weight).view(s, rows, 3, 320)
    query, key, value = torch.split(mixed, [192, 64, 64], dim=3)
    query = query.reshape(s, rows, 9, 64)
    return query.flip(-1), key.flip(-1), value


@pytest.mark.parametrize("packed", [None, "mask", "segments"])
def test_fused_attention_equals_attention_written_out(attention, packed):
    torch.manual_seed(0)
    s, b = 12, 3
    q = torch.randn(s, b, 4, 16)
    k, v = torch.randn(s, b, 2, 16), torch.randn(s, b, 2, 16)
    segments = torch.tensor(SEGMENTS)
    mask = block_causal_mask(segments) if packed else None
    got = attention(q, k, v, segments if packed == "segments" else mask)
    want = reference(q, k, v, mask, 16 ** -0.5)
    assert got.shape == (s, b, 64)
    assert (got.double() - want).abs().max() < 1e-5
    if packed:  # the packed row's second sequence equals that sequence alone in its own row
        alone = attention(q[5:, 1:2], k[5:, 1:2], v[5:, 1:2], None)
        assert (alone - got[5:, 1:2]).abs().max() < 1e-5


def test_rows_laid_end_to_end_in_thd_format_attend_within_their_segments(attention):
    """Megatron's THD format (every row end to end, cu_seqlens at each segment) gives each row's result."""
    from megatron.core.packed_seq_params import PackedSeqParams

    torch.manual_seed(0)
    s, b = 12, 3
    q = torch.randn(s, b, 4, 16)
    k, v = torch.randn(s, b, 2, 16), torch.randn(s, b, 2, 16)
    flat = torch.tensor(SEGMENTS).flatten()
    bounds = [0] + [i for i in range(1, len(flat)) if flat[i] != flat[i - 1] or i % s == 0] + [len(flat)]
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
    ends = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (q, k, v)]  # [b * s, heads, d], row by row
    got = attention(*ends, None, packed_seq_params=params)
    want = reference(q, k, v, block_causal_mask(torch.tensor(SEGMENTS)), 16 ** -0.5)
    assert got.shape == (b * s, 1, 64)
    assert (got[:, 0].double() - want.transpose(0, 1).reshape(b * s, 64)).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_run_by_flex_attention_on_a_gpu_equal_the_dense_mask(attention, dtype):
    """FlexAttention's document-causal block mask against SDPA with the dense mask, values and gradients, at a
    length with several 128-token blocks per sequence and sequences straddling blocks."""
    from megarl.models.attention import document_attention

    torch.manual_seed(0)
    lengths = [[700, 300, 200, 24], [1000, 224]]
    segments = torch.tensor([sum(([i + 1] * n for i, n in enumerate(row)), []) for row in lengths], device="cuda")
    b, s = segments.shape
    q = torch.randn(b, 4, s, 16, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, 2, s, 16, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    flex = document_attention(q, k, v, segments, 0.25)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~block_causal_mask(segments),
                                                             scale=0.25, enable_gqa=True)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (flex.float() - dense.float()).abs().max() < tolerance
    grads = [torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in (flex, dense)]
    for g_flex, g_dense in zip(*grads, strict=True):
        assert (g_flex.float() - g_dense.float()).abs().max() < tolerance * max(1.0, g_dense.abs().max().item())


@pytest.mark.gpu
def test_compiling_ahead_covers_every_later_length_row_count_and_mode():
    """compile_document_attention, which runs beside the engine's start, leaves nothing for the first step to
    compile: packed micro-batches of other lengths, row counts and segment layouts, scored without gradients and
    trained with them, add no graph."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch._dynamo.utils import counters

    import megarl.models.attention as attention

    torch._dynamo.reset()
    attention._compiled_flex = None
    config = TransformerConfig(num_layers=1, hidden_size=576, num_attention_heads=9, num_query_groups=3,
                               kv_channels=64, attention_dropout=0.0, params_dtype=torch.bfloat16)
    core = attention.FusedCoreAttention(config, 1, AttnMaskType.causal, "self")
    assert attention.compile_document_attention([core]) > 0
    graphs = counters["stats"]["unique_graphs"]
    # A recompilation raises with the guard that failed, so that a failure says which shape or layout was missed.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows, lengths in LATER:
            s = sum(lengths)
            segments = later_segments(rows, lengths, "cuda")
            for train in (False, True):
                with torch.set_grad_enabled(train):
                    q, k, v = layer_qkv(s, rows, torch.bfloat16, "cuda", train)
                    out = core(q, k, v, segments)
                    if train:
                        out.float().sum().backward()
                added = counters["stats"]["unique_graphs"] - graphs
                assert not added, f"{added} new graph(s) at {rows} rows of {lengths}, grad {train}"


def test_after_the_warm_up_scoring_shapes_compile_nothing_more_on_cpu():
    """The warm-up's forward graphs cover a scoring micro-batch of any length, row count and segment layout. On an
    H100 one-row micro-batches recompiled at the first step: the warm-up's one-row segments were views of a longer
    tensor, and duck sizing had tied value's offset in the fused projection to the warm-up's length; then every
    scoring micro-batch of several rows recompiled ("tuple index out of range"): the warm-up's value was a view of
    a 4-dimensional tensor, Megatron's is a view of the linear layer's 3-dimensional output. CPU: the same graphs
    through aot_eager (inductor's CPU FlexAttention cannot build this layout), forward alone (no CPU backward)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    import megarl.models.attention as attention

    torch._dynamo.reset()
    attention._compiled_flex = torch.compile(flex_attention, dynamic=True, backend="aot_eager")
    attention._flex_unfused = False
    config = TransformerConfig(num_layers=1, hidden_size=576, num_attention_heads=9, num_query_groups=3,
                               kv_channels=64, attention_dropout=0.0, params_dtype=torch.float32)
    core = attention.FusedCoreAttention(config, 1, AttnMaskType.causal, "self")
    try:
        with torch._dynamo.config.patch(recompile_limit=attention.RECOMPILE_LIMIT):
            attention.warm_document_attention(core, torch.device("cpu"), modes=(False,))
            graphs = counters["stats"]["unique_graphs"]
            with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():  # as scoring runs
                for rows, lengths in LATER:
                    s = sum(lengths)
                    segments = later_segments(rows, lengths)
                    q, k, v = layer_qkv(s, rows, torch.float32, "cpu")
                    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
                    out = attention.document_attention(q, k, v, segments, core.softmax_scale)
                    expected = reference(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), block_causal_mask(segments),
                                         core.softmax_scale)
                    assert torch.allclose(out.permute(2, 0, 1, 3).reshape(expected.shape).double(), expected,
                                          atol=1e-4)
                    assert counters["stats"]["unique_graphs"] == graphs, f"a new graph at {rows} rows of {lengths}"
    finally:
        torch._dynamo.reset()
        attention._compiled_flex = None


def test_flex_attention_past_torch_compiles_limit_takes_sdpa_and_says_so(capsys):
    """Past torch.compile's recompile limit FlexAttention would run eagerly, unfused (every head's [s, s] scores):
    on an H100 the warm-up's graphs reached torch's default limit and the GSM8K recipe's update ran twice as long,
    with nothing but torch's warning. megarl raises the limit, and should it still be reached, packed rows take SDPA
    (fused) with one warning. Run on CPU, where torch compiles FlexAttention too."""
    import megarl.models.attention as attention

    torch._dynamo.reset()
    attention._compiled_flex, attention._flex_unfused = None, False
    gen = torch.Generator().manual_seed(0)
    try:
        with torch._dynamo.config.patch(recompile_limit=8):
            outputs = []
            for rows, length in ((2, 128), (1, 128), (3, 96)):  # one row and another length: new graphs
                segments = (torch.arange(length) // 40).expand(rows, -1).contiguous()
                q, k, v = (torch.randn(rows, h, length, 16, generator=gen) for h in (4, 2, 2))
                outputs.append((attention.document_attention(q, k, v, segments, 0.25), q, k, v, segments))
                if rows == 2:
                    assert torch._dynamo.config.recompile_limit == attention.RECOMPILE_LIMIT
                    assert not attention._flex_unfused
                    torch._dynamo.config.recompile_limit = 1  # as if the limit had been reached
        assert attention._flex_unfused
        for out, q, k, v, segments in outputs:
            expected = reference(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), block_causal_mask(segments), 0.25)
            assert torch.allclose(out.permute(2, 0, 1, 3).reshape(expected.shape).double(), expected, atol=1e-5)
        warnings = [line for line in capsys.readouterr().out.splitlines() if "recompile limit" in line]
        assert len(warnings) == 1 and "SDPA" in warnings[0] and "1 row(s) of 128 tokens" in warnings[0], warnings
    finally:
        torch._dynamo.reset()
        attention._compiled_flex, attention._flex_unfused = None, False

