"""Forward passes over Megatron's pipeline schedule: per-token log-probabilities of given sequences."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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


def forward_only(chunks: list[torch.nn.Module], groups: ParallelGroups, batches: list[torch.Tensor],
                 collect: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor] | None:
    """Run [B, S] token micro-batches through the pipeline without grad.

    ``collect(tokens, output)`` maps the last stage's model output ([B, S, V_local] logits, or
    [B, S, 1] values for the critic) to what is kept. Returns the kept tensors in micro-batch
    order on the last pipeline stage, None elsewhere. With pipeline parallelism all micro-batches
    must share one shape.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # Pipeline stages need one shape for all micro-batches; without pipelining shapes may vary.
    micro_batch_size, length = max(b.shape[0] for b in batches), max(b.shape[1] for b in batches)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def forward_step(data: Iterator[torch.Tensor], model: torch.nn.Module) -> Any:
        tokens = next(data).to(device)
        positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)

        def keep(output: torch.Tensor, non_loss_data: bool = False) -> torch.Tensor:
            assert non_loss_data
            return collect(tokens, output)

        return model(tokens, positions, None), keep

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
    return list(outputs) if groups.is_last_stage else None


def micro_batches(sequences: Sequence[Sequence[int]], micro_batch_size: int) -> list[torch.Tensor]:
    """Right-padded [B, S] micro-batches of equal shape; a short last one is filled with copies."""
    length = max(len(s) for s in sequences)
    batches = [pad_batch(sequences[i: i + micro_batch_size], length)
               for i in range(0, len(sequences), micro_batch_size)]
    short = micro_batch_size - batches[-1].shape[0]
    if short:
        batches[-1] = torch.cat([batches[-1], batches[-1][:1].expand(short, -1)])
    return batches


def sequence_logprobs(chunks: list[torch.nn.Module], spec: ModelSpec, groups: ParallelGroups,
                      sequences: Sequence[Sequence[int]], *, micro_batch_size: int = 1,
                      vocab_pad_multiple: int = 128) -> list[list[float]] | None:
    """log p(token_t | tokens_<t) for t >= 1 of every sequence, in input order.

    Every rank of a pipeline must pass the same ``sequences``. Returns one list of
    ``len(seq) - 1`` floats per sequence on the last pipeline stage, None elsewhere.
    Causal attention keeps right padding from influencing real tokens; padded positions
    are dropped from the result.
    """
    assert sequences and all(len(s) >= 2 for s in sequences), "every sequence needs at least two tokens"
    padded_vocab = spec.padded_vocab_size(groups.dims.tp, vocab_pad_multiple)
    vocab_start = groups.tp_rank * padded_vocab // groups.dims.tp

    def logprobs(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab_start=vocab_start,
                                       vocab_size=spec.vocab_size, group=groups.tp_group).cpu()

    outputs = forward_only(chunks, groups, micro_batches(sequences, micro_batch_size), logprobs)
    if outputs is None:
        return None
    rows = torch.cat(outputs)[: len(sequences)]
    return [rows[i, : len(seq) - 1].tolist() for i, seq in enumerate(sequences)]
