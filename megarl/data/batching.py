"""From prompt records to model inputs: tokenization, token-budget micro-batches, sequence packing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import BatchEncoding, PreTrainedTokenizerBase

from megarl.data.prompts import PromptRecord
from megarl.errors import UserError


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    record: PromptRecord
    tokens: list[int]


def tokenize_prompts(
    records: Sequence[PromptRecord],
    tokenizer: PreTrainedTokenizerBase,
    apply_chat_template: bool,
    max_prompt_tokens: int,
) -> tuple[list[TokenizedPrompt], int]:
    """Tokenize prompts and drop those longer than max_prompt_tokens; returns (kept, number dropped).

    With apply_chat_template and a tokenizer that has a chat template, each prompt becomes one user
    turn followed by the assistant header; otherwise it is encoded as plain text (with the tokenizer's
    BOS, if any). Kept prompts stay in input order, each with its record so answers stay aligned.
    """
    if not records:
        return [], 0
    prompts = [record.prompt for record in records]
    if apply_chat_template and tokenizer.chat_template is not None:
        conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
        encoded = cast(
            BatchEncoding,
            tokenizer.apply_chat_template(conversations, tokenize=True, add_generation_prompt=True, return_dict=True),
        )
    else:
        encoded = tokenizer(prompts)
    kept = [
        TokenizedPrompt(record, list(tokens))
        for record, tokens in zip(records, encoded["input_ids"], strict=True)
        if len(tokens) <= max_prompt_tokens
    ]
    return kept, len(records) - len(kept)


def token_budget_batches(lengths: Sequence[int], max_tokens: int, field: str = "max_tokens_per_gpu") -> list[list[int]]:
    """Group sequence indices into micro-batches whose lengths sum to at most max_tokens.

    First-fit decreasing: longest first, each into the first micro-batch with room, which keeps the
    number of micro-batches near the minimum and fills them evenly. Ties keep index order, so the
    result depends only on the input. A sequence longer than max_tokens is a UserError naming `field`.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if order and lengths[order[0]] > max_tokens:
        longest = lengths[order[0]]
        raise UserError(
            f"{field} = {max_tokens}, but a sequence has {longest} tokens and cannot fit in one micro-batch. "
            f"Fix: raise {field} to at least {longest}."
        )
    batches: list[list[int]] = []
    room: list[int] = []
    for i in order:
        slot = next((b for b, free in enumerate(room) if lengths[i] <= free), None)
        if slot is None:
            batches.append([])
            room.append(max_tokens)
            slot = len(batches) - 1
        batches[slot].append(i)
        room[slot] -= lengths[i]
    return batches


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """Sequences laid end to end, as varlen attention (THD format) takes them."""

    tokens: torch.Tensor
    """[1, total] int64."""
    position_ids: torch.Tensor
    """[1, total] int64, restarting at 0 for each sequence."""
    cu_seqlens: torch.Tensor
    """[n + 1] int32: sequence i is tokens[0, cu_seqlens[i]:cu_seqlens[i + 1]]."""
    max_seqlen: int


def pack_sequences(seqs: Sequence[Sequence[int]]) -> PackedBatch:
    """Pack n non-empty token sequences into one row with per-sequence positions and boundaries."""
    if not seqs or any(len(seq) == 0 for seq in seqs):
        raise ValueError("pack_sequences: needs at least one sequence and no empty ones")
    lengths = torch.tensor([len(seq) for seq in seqs])
    cu_seqlens = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    total = int(cu_seqlens[-1])
    # Position of each token = its index minus the start of its sequence.
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    positions = torch.arange(total) - starts
    tokens = torch.tensor([token for seq in seqs for token in seq], dtype=torch.long)
    return PackedBatch(
        tokens=tokens.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()),
    )
