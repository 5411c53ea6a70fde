"""Forward passes over Megatron's pipeline schedule: per-token log-probabilities of given sequences."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch

from megarl.models.logprobs import vocab_parallel_logprobs
from megarl.models.spec import ModelSpec
from megarl.parallel import ParallelGroups


def pad_batch(sequences: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> torch.Tensor:
    out = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return out


def sequence_logprobs(chunks: list[torch.nn.Module], spec: ModelSpec, groups: ParallelGroups,
                      sequences: Sequence[Sequence[int]], *, micro_batch_size: int = 1,
                      vocab_pad_multiple: int = 128) -> list[list[float]] | None:
    """log p(token_t | tokens_<t) for t >= 1 of every sequence, in input order.

    Every rank of a pipeline must pass the same ``sequences``. Returns one list of
    ``len(seq) - 1`` floats per sequence on the last pipeline stage, None elsewhere.
    Sequences are right-padded to a common length; causal attention keeps the padding
    from influencing real tokens, and padded positions are dropped from the result.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    assert sequences and all(len(s) >= 2 for s in sequences), "every sequence needs at least two tokens"
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    length = max(len(s) for s in sequences)
    batches = [pad_batch(sequences[i: i + micro_batch_size], length)
               for i in range(0, len(sequences), micro_batch_size)]
    # The schedule needs equal micro-batches; a short last one is padded with copies and trimmed after.
    last_rows = batches[-1].shape[0]
    if last_rows < micro_batch_size:
        batches[-1] = torch.cat([batches[-1], batches[-1][:1].expand(micro_batch_size - last_rows, -1)])
    padded_vocab = spec.padded_vocab_size(groups.dims.tp, vocab_pad_multiple)
    vocab_start = groups.tp_rank * padded_vocab // groups.dims.tp

    def batch_iter() -> Iterator[torch.Tensor]:
        yield from batches

    def collect(tokens: torch.Tensor, logits: torch.Tensor, non_loss_data: bool = False) -> Any:
        assert non_loss_data
        return vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab_start=vocab_start,
                                       vocab_size=spec.vocab_size, group=groups.tp_group).cpu()

    def forward_step(data: Iterator[torch.Tensor], model: torch.nn.Module) -> Any:
        tokens = next(data).to(device)
        positions = torch.arange(length, device=device).unsqueeze(0).expand_as(tokens)
        return model(tokens, positions, None), partial(collect, tokens)

    num_chunks = len(chunks)
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[batch_iter() for _ in chunks] if num_chunks > 1 else batch_iter(),
            model=chunks if num_chunks > 1 else chunks[0],
            num_microbatches=len(batches),
            seq_length=length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not groups.is_last_stage:
        return None
    rows = torch.cat(list(outputs))[: len(sequences)]
    return [rows[i, : len(seq) - 1].tolist() for i, seq in enumerate(sequences)]
