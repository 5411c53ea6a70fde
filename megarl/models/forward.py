"""Forward passes over Megatron's pipeline schedule: per-token log-probabilities of given sequences."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megarl.data.batching import Layout, MicroBatch, build_micro_batches
from megarl.distributed.parallel import ParallelGroups
from megarl.models import logprob_head
from megarl.models.logprobs import vocab_parallel_logprobs
from megarl.models.spec import ModelSpec


def model_inputs(batch: MicroBatch, device: torch.device, thd: bool = False, padding: bool = False
                 ) -> tuple[torch.Tensor, dict[str, Any]]:
    """(tokens [r, s], GPTModel.forward's inputs) for one micro-batch; with ``padding`` its ``padding_mask`` too
    (True on padding, in input_ids' shape), which keeps padding out of an MoE router's load-balancing loss.

    Without ``thd`` the rows go in as they are; the mask of packed rows is their [b, s] segment ids, which megarl's
    core attention (megarl.models.attention) reads, None for plain causal rows. GPTModel's RoPE then rotates by
    row position 0..s-1 whatever the position ids say, so a sequence packed at offset o is rotated by o more than
    alone. Attention scores under RoPE depend only on the distance between two tokens, and the mask keeps
    attention within a sequence, so scores, and everything after them, equal the unpacked ones up to float
    rounding.

    With ``thd`` (Megatron's packed format, Transformer Engine's attention) the rows go in end to end as one
    [1, r * s] row with ``thd_params``: every sequence, and every row's padding, is a segment of its own, which
    attention keeps apart and RoPE rotates from position 0. Every micro-batch goes in this way, packed or not, so
    pipeline stages exchange one shape. The model's output comes back as [1, r * s, ...]: ``output_rows`` gives
    it the micro-batch's [r, s, ...] shape.
    """
    tokens = batch.tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    pad = {"padding_mask": batch.padding().to(device)} if padding else {}
    if thd:
        return tokens, {"input_ids": tokens.reshape(1, -1), "position_ids": positions.reshape(1, -1),
                        "attention_mask": None, "packed_seq_params": thd_params(batch, device)} | {
                            k: v.reshape(1, -1) for k, v in pad.items()}
    mask = None if batch.segments is None else batch.segments.to(device)
    return tokens, {"input_ids": tokens, "position_ids": positions, "attention_mask": mask} | pad


def thd_params(batch: MicroBatch, device: torch.device) -> Any:
    """PackedSeqParams of the micro-batch's rows laid end to end: a segment boundary where each row, each sequence
    and each row's padding begins."""
    from megatron.core.packed_seq_params import PackedSeqParams

    rows, width = batch.tokens.shape
    starts = {r * width for r in range(rows)}
    for _, row, start, n in batch.spans:
        starts |= {row * width + start, row * width + start + n}
    bounds = sorted(b for b in starts if b < rows * width) + [rows * width]
    longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def output_rows(output: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The last stage's [b, s', ...] output ([1, r * s, ...] in THD format) as [r, s, ...], like ``tokens``."""
    return output.reshape(*tokens.shape, *output.shape[2:])


def schedule_shape(batches: list[MicroBatch], thd: bool) -> tuple[int, int]:
    """(seq_length, micro_batch_size) of Megatron's pipeline schedule: the activations stages exchange."""
    rows, width = max(b.tokens.shape[0] for b in batches), max(b.tokens.shape[1] for b in batches)
    return (rows * width, 1) if thd else (width, rows)


def forward_only(chunks: list[torch.nn.Module], groups: ParallelGroups, batches: list[MicroBatch],
                 collect: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 prepare: Callable[[torch.nn.Module, MicroBatch], None] | None = None, thd: bool = False
                 ) -> list[torch.Tensor] | None:
    """Run micro-batches of [B, S] token rows through the pipeline without grad (``thd``: in Megatron's packed
    format, ``model_inputs``).

    ``collect(tokens, output)`` maps the last stage's model output ([B, S, V_local] logits, [B, S, 3] from a
    chunked head (megarl.models.logprob_head), or
    [B, S, 1] values for the critic) to what is kept, on the device. Returns the kept tensors in micro-batch
    order on the last pipeline stage, in host memory, None elsewhere. They come to the host after the last
    micro-batch: a copy per micro-batch would make the host wait for the device each time, and the device then
    idle while the host launches the next micro-batch's kernels (or, beside an engine generating on the same GPU,
    wait for the engine's turn as well). With pipeline parallelism all micro-batches
    must share one shape. ``prepare(chunk, batch)`` runs before each chunk's forward of a micro-batch.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # Pipeline stages need one shape for all micro-batches; without pipelining shapes may vary.
    length, micro_batch_size = schedule_shape(batches, thd)
    device = groups.device

    def forward_step(data: Iterator[MicroBatch], model: torch.nn.Module) -> Any:
        batch = next(data)
        if prepare is not None:
            prepare(model, batch)
        tokens, inputs = model_inputs(batch, device, thd)

        def keep(output: torch.Tensor, non_loss_data: bool = False) -> torch.Tensor:
            assert non_loss_data
            return collect(tokens, output_rows(output, tokens))

        return model(**inputs), keep

    multi = len(chunks) > 1
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks] if multi else iter(batches),
            model=chunks if multi else chunks[0],
            num_microbatches=len(batches),
            seq_length=length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
            collect_non_loss_data=True,
        )
    return [kept.cpu() for kept in outputs] if groups.is_last_stage else None


def even_micro_batches(batches: list[MicroBatch], groups: ParallelGroups, width_multiple: int = 1
                       ) -> list[MicroBatch]:
    """``batches`` in a count the schedule can run, made up with empty micro-batches (padding only, no sequence,
    no loss weight):
    - with experts split over DP ranks (expert parallelism) every rank must run as many forward passes as the
      others, a rank with no sequence at all included (each MoE layer exchanges tokens all-to-all): up to the
      most any DP rank has;
    - the interleaved (virtual) pipeline schedule runs micro-batches in groups of PP: a multiple of PP."""
    dims = groups.dims
    count = len(batches)
    if dims.ep > 1:
        most = torch.tensor([count], device=groups.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=groups.dp_group)
        count = int(most.item())
    if dims.vpp:
        count = -(-count // dims.pp) * dims.pp
    shape = batches[-1].tokens.shape if batches else (1, max(2, width_multiple))
    empty = MicroBatch(torch.zeros(shape, dtype=torch.long), None, [])
    return batches + [empty] * (count - len(batches))


def micro_batches(sequences: Sequence[Sequence[int]], micro_batch_size: int, width_multiple: int = 1
                  ) -> list[MicroBatch]:
    """Micro-batches of ``micro_batch_size`` rows, one sequence per row in input order, all padded to
    the longest sequence (rounded up to ``width_multiple``); a short last one is filled with empty rows."""
    n = len(sequences)
    width = -(-max(len(s) for s in sequences) // width_multiple) * width_multiple
    rows = [[[i] for i in range(start, min(start + micro_batch_size, n))] for start in range(0, n, micro_batch_size)]
    return build_micro_batches(sequences, Layout(rows, [width] * len(rows), [micro_batch_size] * len(rows)))


def sequence_logprobs(chunks: list[torch.nn.Module], spec: ModelSpec, groups: ParallelGroups,
                      sequences: Sequence[Sequence[int]], *, micro_batch_size: int = 1,
                      vocab_pad_multiple: int = 128, temperature: float = 1.0, chunk_tokens: int = 0
                      ) -> list[list[float]] | None:
    """log p(token_t | tokens_<t) for t >= 1 of every sequence, in input order, under softmax(logits / temperature).
    ``chunk_tokens`` > 0: from the output layer's input that many tokens at a time, never the whole logits
    (megarl.models.logprob_head, installed on ``chunks``).

    Every rank of a pipeline must pass the same ``sequences`` (under expert parallelism possibly none: the rank
    still runs the MoE layers' exchanges). Returns one list of
    ``len(seq) - 1`` floats per sequence on the last pipeline stage, None elsewhere.
    Causal attention keeps right padding from influencing real tokens; padded positions
    are dropped from the result.
    """
    assert all(len(s) >= 2 for s in sequences), "every sequence needs at least two tokens"
    assert sequences or groups.dims.ep > 1, "no sequences to score"
    padded_vocab = spec.padded_vocab_size(groups.dims.tp, vocab_pad_multiple)
    vocab_start = groups.tp_rank * padded_vocab // groups.dims.tp

    def logprobs(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if chunk_tokens:
            return logits[:, :-1, 0]
        return vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab_start=vocab_start,
                                       vocab_size=spec.vocab_size, group=groups.tp_group,
                                       temperature=temperature)

    def aim(chunk: torch.nn.Module, batch: MicroBatch) -> None:
        logprob_head.aim(chunk, batch.tokens.to(groups.device), thd=False)

    batches = even_micro_batches(micro_batches(sequences, micro_batch_size) if sequences else [], groups)
    if chunk_tokens:
        with logprob_head.installed(chunks, vocab_start=vocab_start, vocab_size=spec.vocab_size,
                                    temperature=temperature, chunk_tokens=chunk_tokens, group=groups.tp_group):
            outputs = forward_only(chunks, groups, batches, logprobs, aim)
    else:
        outputs = forward_only(chunks, groups, batches, logprobs, None)
    if outputs is None:
        return None
    rows = torch.cat(outputs)[: len(sequences)]
    return [rows[i, : len(seq) - 1].tolist() for i, seq in enumerate(sequences)]
