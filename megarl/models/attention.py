"""Core attention of megarl's local (non-Transformer-Engine) layer spec: torch's fused attention (SDPA).

Megatron's local ``DotProductAttention`` materialises every head's [s, s] score matrix in float32, masks,
softmaxes and multiplies again: memory and time quadratic in the row length, on every GPU without TE. SDPA
picks a fused kernel (flash, cuDNN or memory-efficient attention on GPUs, a fused CPU kernel elsewhere)
with the same mathematics: softmax(q k^T * scale + mask) v, grouped-query heads shared without copies.
Rows of one sequence use the causal flag. Rows of packed sequences arrive as their segment ids, or laid end
to end in Megatron's THD format, whose cu_seqlens become segment ids (megarl.models.forward): on GPUs
FlexAttention runs them under a document-causal block mask, compiled once and built once per micro-batch,
which skips the blocks between sequences instead of computing and masking them and never holds a dense
[s, s] mask; elsewhere (CPU) SDPA takes the dense block-causal mask.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, s] segment ids -> [b, 1, s, s] bool attention mask, True = masked out.

    A token attends to itself and the earlier tokens of its own segment only, so sequences packed
    into one row do not see each other (every token sees at least itself: no row is all masked). The local
    spec's fused attention (below) passes it to SDPA; Transformer Engine's takes it too.
    Its memory is b * s^2 bytes per micro-batch, shared by every layer and head.
    """
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    same = segments.unsqueeze(2) == segments.unsqueeze(1)
    return ~(same & causal).unsqueeze(1)


class FusedCoreAttention(MegatronModule):
    """Drop-in for ``DotProductAttention`` (same constructor and forward; no context parallelism, no attention bias).
    Packed rows come as their segment ids, passed as the mask, or in Megatron's THD format (``packed_seq_params``)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        assert config.context_parallel_size == 1, "context parallelism needs Transformer Engine's attention"
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        assert head_dim is not None
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        """query [s, b, heads, d], key and value [s, b, kv heads, d] (this TP rank's heads); attention_mask
        None (causal), int64 [b, s] segment ids of packed rows (a token attends to the earlier tokens of its
        own segment), or bool [b, 1, s, s], True = masked out. Returns [s, b, heads * d]. In THD format
        (``packed_seq_params``) query, key and value are [t, heads, d], one row of segments from cu_seqlens."""
        assert attention_bias is None, "attention bias needs Transformer Engine"
        if packed_seq_params is not None:
            assert packed_seq_params.qkv_format == "thd" and attention_mask is None, packed_seq_params
            attention_mask = thd_segments(packed_seq_params.cu_seqlens_q, query.shape[0])
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        dropout = self.dropout if self.training else 0.0
        segments = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if segments is not None and q.is_cuda and not dropout:
            out = document_attention(q, k, v, segments, self.softmax_scale)
        else:
            if segments is not None:
                attention_mask = _mask_of(segments, flex=False)
            causal = attention_mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            forked = dropout and not self.config.sequence_parallel  # as Megatron's: dropout streams per TP rank
            with tensor_parallel.get_cuda_rng_tracker().fork() if forked else nullcontext():
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, dropout_p=dropout,
                    is_causal=causal, scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


_last_thd: tuple[torch.Tensor, torch.Tensor] | None = None
"""(cu_seqlens, segment ids) last converted: every layer of a micro-batch gets the same cu_seqlens tensor, and one
segments tensor for all of them lets ``_mask_of`` build the mask once."""


def thd_segments(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[1, t] segment ids of a THD row: segment k spans tokens cu_seqlens[k] to cu_seqlens[k + 1]."""
    global _last_thd
    if _last_thd is None or _last_thd[0] is not cu_seqlens:
        starts = torch.zeros(num_tokens, dtype=torch.long, device=cu_seqlens.device)
        starts[cu_seqlens[1:-1].long()] = 1
        _last_thd = (cu_seqlens, starts.cumsum(0).unsqueeze(0))
    return _last_thd[1]


RECOMPILE_LIMIT = 64
"""torch.compile's recompile limit (per function) from the first FlexAttention call on. The warm-up alone makes 12
graphs of flex_attention (6 shapes in 2 modes) and more of the block mask; at torch's default of 8 every later call
ran eagerly, unfused, materialising every head's [s, s] scores: on an H100 the GSM8K recipe's update took 3.9-6.2 s
instead of 2.2-2.7 s and its scoring 4 GiB more memory, and only torch's own warning said so."""

_compiled_flex: Any = None
_flex_unfused = False
"""Set once torch.compile can no longer compile FlexAttention's shapes: packed rows then take SDPA's dense mask."""
_last_mask: tuple[torch.Tensor, bool, Any] | None = None
"""The mask of the segments tensor last seen, built once for all the layers of a micro-batch's forward (they get
the same tensor); holding the tensor keeps its identity from being reused by another micro-batch's."""


def _mask_of(segments: torch.Tensor, flex: bool) -> Any:
    """FlexAttention's document-causal block mask (``flex``) or the dense block-causal one of ``segments``."""
    global _last_mask
    if _last_mask is None or _last_mask[0] is not segments or _last_mask[1] != flex:
        mask: Any
        if flex:
            from torch.nn.attention.flex_attention import create_block_mask

            # A tensor of its own: the compiled graphs guard on the closure's tensor, down to the size of the tensor
            # it views (a one-row segments tensor expanded from a longer one did not match a later one of its own).
            doc = segments.clone()

            def same_document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

            b, s = segments.shape
            with torch.no_grad():  # the mask takes no gradient: the same graphs serve scoring and training
                mask = create_block_mask(same_document, b, None, s, s, device=segments.device, _compile=True)
        else:
            mask = block_causal_mask(segments)
        _last_mask = (segments, flex, mask)
    return _last_mask[2]


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Causal attention within each segment of packed rows, by FlexAttention (CUDA): q [b, heads, s, d], k and v
    [b, kv heads, s, d], segments [b, s]. Returns [b, heads, s, d]."""
    global _compiled_flex, _flex_unfused
    import torch.fx.experimental._config as fx_config
    from torch._dynamo.exc import FailOnRecompileLimitHit
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    gqa = q.shape[1] != k.shape[1]
    if not _flex_unfused:
        # Past the limit torch would run flex_attention eagerly, unfused: fail instead, and take SDPA, which is fused.
        try:
            # Without duck sizing: sizes that happen to be equal in one call (a length and value's offset in the
            # fused projection, a row count and a block count) would otherwise be guarded equal in every later one.
            no_duck = fx_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]  # added at its import
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), no_duck:
                return _compiled_flex(q, k, v, block_mask=_mask_of(segments, flex=True), scale=scale, enable_gqa=gqa)
        except FailOnRecompileLimitHit:
            _flex_unfused = True
            print(f"megarl: warning: torch.compile reached its recompile limit "
                  f"({torch._dynamo.config.recompile_limit}) for FlexAttention at {q.shape[0]} row(s) of "
                  f"{q.shape[2]} tokens; packed rows now take SDPA with a dense [b, s, s] mask (the same attention, "
                  "more memory and time). TORCH_LOGS=recompiles shows which shapes compiled.", flush=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~_mask_of(segments, flex=False), scale=scale,
                                          enable_gqa=gqa)


def compile_document_attention(modules: list[torch.nn.Module]) -> float:
    """Compile FlexAttention's document-causal kernels for the first ``FusedCoreAttention`` of ``modules`` (every
    layer of a model shares its heads, head size and scale), forward alone as scoring runs it and forward with
    backward as the update does, on micro-batches of one row and of several, and return the seconds it took (0 where
    the model does not run FlexAttention: on CPU, with dropout, or with another core attention).

    The first step otherwise pays these compilations (5.5 s on an H100, and a recompilation for each shape that
    differs from the first); run beside the engine's start (megarl.loop.trainer), they cost no wall time.
    torch.compile(dynamic=True) keeps one FlexAttention graph per mode for every length but specializes a size of
    1, hence one row and several; the block mask (create_block_mask's own compilation) turns dynamic only at its
    second shape, hence two lengths; and a length that FlexAttention's blocks do not divide takes other kernels
    than one they divide (its masked last block), hence 301 beside 256 and 320, with one row and with several.
    Query, key and value come with Megatron's layout (``megatron_qkv``): the graphs guard on their strides."""
    core = next((m for chunk in modules for m in chunk.modules() if isinstance(m, FusedCoreAttention)), None)
    if core is None or core.dropout or not torch.cuda.is_available():
        return 0.0
    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    warm_document_attention(core, device, modes=(False, True))
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def warm_document_attention(core: FusedCoreAttention, device: torch.device, modes: tuple[bool, ...]) -> None:
    """Run ``core``'s document attention once for each shape compile_document_attention covers, in each mode of
    ``modes`` (False: forward alone, True: forward and backward)."""
    config = core.config
    tp = config.tensor_model_parallel_size
    heads = config.num_attention_heads // tp
    kv_heads = max(1, (config.num_query_groups or config.num_attention_heads) // tp)
    head_dim = config.kv_channels
    assert head_dim is not None
    # The block mask compiles for its first shape, then once more with the sizes that changed made dynamic.
    for rows, length in ((2, 256), (3, 320), (1, 256), (2, 301), (1, 301), (1, 320)):
        segments = (torch.arange(length, device=device) // 96).expand(rows, -1).contiguous()
        for train in modes:
            with torch.set_grad_enabled(train):
                q, k, v = megatron_qkv(length, rows, heads, kv_heads, head_dim, config.params_dtype, device, train)
                q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d], as forward() passes them
                out = document_attention(q, k, v, segments, core.softmax_scale)
                if train:
                    out.sum().backward()


def megatron_qkv(s: int, rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, requires_grad: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random query, key and value [s, rows, heads or kv heads, head_dim] laid out as Megatron's self-attention
    hands them to core attention, which the compiled graphs guard on: the QKV projection's [s, rows, groups *
    (heads / groups + 2) * head_dim] output viewed as [s, rows, groups, ...] and split, query and key rotated (new
    tensors), value a view of the projection. The graphs guard on value's base too: with a base of 4 dimensions
    (the view itself) every real micro-batch of several rows failed the warm-up's guards ("tuple index out of
    range") and compiled anew at the first step. With fewer query groups than TP ranks Megatron slices an all-gathered
    projection instead (get_query_key_value_tensors), which this does not lay out: such a model may compile at its
    first step."""
    per = heads // kv_heads
    projection = torch.randn(s, rows, kv_heads * (per + 2) * head_dim, device=device, dtype=dtype,
                             requires_grad=requires_grad) * 1  # a linear layer's output: no leaf under autograd
    mixed = projection.view(s, rows, kv_heads, (per + 2) * head_dim)
    query, key, value = torch.split(mixed, [per * head_dim, head_dim, head_dim], dim=3)
    return query.reshape(s, rows, heads, head_dim) * 1, key * 1, value
