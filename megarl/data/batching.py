"""From prompt records to model inputs: tokenization, token-budget micro-batches with sequence packing."""

from __future__ import annotations

import bisect
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
    drop_long: bool = False,
    source: str = "the prompt file",
    system_prompt: str | None = None,
    response_prefix: str | None = None,
    field: str = "data.train_path",
    limit_field: str = "rollout.max_prompt_tokens",
) -> tuple[list[TokenizedPrompt], int]:
    """Tokenize prompts; returns (kept, number dropped). A prompt longer than max_prompt_tokens is an error
    naming ``field`` (where the prompts come from: a config field or a command-line flag), ``source``, the count
    and the longest, unless ``drop_long`` (data.drop_long_prompts) drops it; ``limit_field`` names the limit.

    With apply_chat_template and a tokenizer that has a chat template, each prompt becomes one user
    turn followed by the assistant header; otherwise it is encoded as plain text (with the tokenizer's
    BOS, if any). ``system_prompt`` (data.system_prompt) is a system turn before each user turn, or without
    the chat template text before the prompt and a blank line. ``response_prefix`` (data.response_prefix) is
    encoded on its own and appended: the response starts with it, but it is prompt, never generated or trained on.
    Kept prompts stay in input order, each with its record so answers stay aligned.
    """
    if not records:
        return [], 0
    prompts = [record.prompt for record in records]
    if apply_chat_template and tokenizer.chat_template is not None:
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        conversations = [[*system, {"role": "user", "content": prompt}] for prompt in prompts]
        encoded = cast(
            BatchEncoding,
            tokenizer.apply_chat_template(conversations, tokenize=True, add_generation_prompt=True, return_dict=True),
        )
    else:
        encoded = tokenizer([prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}" for prompt in prompts])
    prefix = tokenizer.encode(response_prefix, add_special_tokens=False) if response_prefix else []
    ids = [list(tokens) + prefix for tokens in encoded["input_ids"]]
    lengths = [len(tokens) for tokens in ids]
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        where = records[empty[0]].source or f"{source} record {empty[0] + 1}"
        raise UserError(f"{field} {where}: the prompt {records[empty[0]].prompt!r} encodes to no tokens "
                        f"({len(empty)} of {len(records)} prompts do), and the engine cannot generate from an empty "
                        "prompt. Fix: remove those records, or encode the prompts with a chat template (a tokenizer "
                        "that has one, and data.apply_chat_template: true or no --no-chat-template).")
    long = [i for i, n in enumerate(lengths) if n > max_prompt_tokens]
    if long and not drop_long:
        worst = max(long, key=lambda i: lengths[i])
        drop = ", or set data.drop_long_prompts: true to train without them" if field == "data.train_path" else ""
        raise UserError(f"{field} = {source}: {len(long)} of {len(records)} prompts are longer than "
                        f"{limit_field} = {max_prompt_tokens} tokens (after the chat template; the "
                        f"longest, record {worst + 1}, has {lengths[worst]}). Fix: raise {limit_field} "
                        f"to {lengths[worst]}{drop}.")
    kept = [TokenizedPrompt(record, list(tokens))
            for record, tokens, n in zip(records, ids, lengths, strict=True) if n <= max_prompt_tokens]
    return kept, len(records) - len(kept)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where one step's sequences go: micro-batch -> row -> sequence indices laid end to end."""

    micro_batches: list[list[list[int]]]
    widths: list[int]
    """Row length of each micro-batch."""
    num_rows: list[int]
    """Rows of each micro-batch, at least its filled ones (under ``uniform`` empty rows even out the count)."""


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, *, uniform: bool, pack: bool,
                       field: str = "max_tokens_per_gpu", width_multiple: int = 1) -> Layout:
    """Token-budget micro-batches of rows x width <= max_tokens token slots, padding included.

    Sequences are placed longest first. A micro-batch's rows are as long as its first (longest)
    sequence and it has max_tokens // width of them; sequences that fit nowhere start the next one.
    With ``pack`` several sequences share a row (best-fit decreasing) instead of padding one each.
    Rows are as long as the longest sequence rather than max_tokens because attention over a row
    costs width^2: wider rows would trade padding for masked-out attention. Pipeline stages exchange
    fixed-shape activations, so with ``uniform`` all rows are as long as the step's longest sequence
    and are dealt out evenly, every micro-batch getting the same row count (empty rows fill the last
    one). Ties keep index order, so the result depends only on the input. Row widths are rounded up to
    ``width_multiple`` (sequence parallelism splits rows over the TP ranks). A sequence longer than
    max_tokens is a UserError naming ``field``.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if not order:
        return Layout([], [], [])

    def row_width(n: int) -> int:
        return -(-n // width_multiple) * width_multiple

    if row_width(lengths[order[0]]) > max_tokens:
        longest = row_width(lengths[order[0]])
        raise UserError(
            f"{field} = {max_tokens}, but a sequence has {longest} tokens and cannot fit in one micro-batch. "
            f"Fix: raise {field} to at least {longest}."
        )
    if uniform:
        width = row_width(lengths[order[0]])
        rows, _ = _best_fit(order, lengths, width, len(order), pack)
        count = -(-len(rows) // (max_tokens // width))
        size = -(-len(rows) // count)
        return Layout([rows[k: k + size] for k in range(0, len(rows), size)], [width] * count, [size] * count)
    batches: list[list[list[int]]] = []
    widths: list[int] = []
    while order:
        widths.append(row_width(lengths[order[0]]))
        rows, order = _best_fit(order, lengths, widths[-1], max_tokens // widths[-1], pack)
        batches.append(rows)
    return Layout(batches, widths, [len(rows) for rows in batches])


def _best_fit(order: list[int], lengths: Sequence[int], width: int, max_rows: int, pack: bool
              ) -> tuple[list[list[int]], list[int]]:
    """Sequences ``order`` (longest first) into at most ``max_rows`` rows of ``width`` tokens, each into
    the fullest row it fits in (with ``pack``) or a row of its own; returns (rows, sequences left over)."""
    smallest = lengths[order[-1]]
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room, row) of the rows that can still take the shortest sequence
    rest: list[int] = []
    for pos, i in enumerate(order):
        k = bisect.bisect_left(free, (lengths[i], -1))
        if pack and k < len(free):
            room, slot = free.pop(k)
        elif len(rows) < max_rows:
            room, slot = width, len(rows)
            rows.append([])
        else:
            rest.append(i)
            continue
        rows[slot].append(i)
        room -= lengths[i]
        if pack and room >= smallest:
            bisect.insort(free, (room, slot))
        if len(rows) == max_rows and not free:
            return rows, rest + order[pos + 1:]  # full: nothing further can be placed
    return rows, rest


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Token rows, each holding one or more sequences end to end, right-padded with token 0."""

    tokens: torch.Tensor
    """[r, s] int64."""
    segments: torch.Tensor | None
    """[r, s] int64: k + 1 on the tokens of the k-th sequence of a row, 0 on padding. None when no
    row holds two sequences: plain causal attention is then already exact."""
    spans: list[tuple[int, int, int, int]]
    """(sequence index, row, start, length) of each sequence here."""

    def place(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-sequence [len-1] tensors (``values[i]`` for sequence i) -> [r, s-1], 0 at every other position.

        Position start+len-1, where a sequence's last token "predicts" the next sequence's first,
        and padding get 0, so a weight of 0 keeps them out of every loss.
        """
        out = torch.zeros(self.tokens.shape[0], self.tokens.shape[1] - 1, dtype=values[0].dtype)
        for i, row, start, n in self.spans:
            out[row, start: start + n - 1] = values[i]
        return out

    def take(self, out: torch.Tensor) -> dict[int, torch.Tensor]:
        """[r, s-1, ...] per-position results -> {sequence index: its [len-1, ...] slice}."""
        return {i: out[row, start: start + n - 1] for i, row, start, n in self.spans}

    def padding(self) -> torch.Tensor:
        """[r, s] bool: True where no sequence is."""
        pad = torch.ones_like(self.tokens, dtype=torch.bool)
        for _, row, start, n in self.spans:
            pad[row, start: start + n] = False
        return pad

    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return sum(n for _, _, _, n in self.spans)


def build_micro_batches(sequences: Sequence[Sequence[int]], layout: Layout) -> list[MicroBatch]:
    """The token rows of ``layout`` filled with ``sequences``."""
    out = []
    for rows, width, num_rows in zip(layout.micro_batches, layout.widths, layout.num_rows, strict=True):
        tokens = torch.zeros(num_rows, width, dtype=torch.long)
        segments = torch.zeros_like(tokens)
        spans = []
        for r, row in enumerate(rows):
            start = 0
            for k, i in enumerate(row):
                n = len(sequences[i])
                tokens[r, start: start + n] = torch.as_tensor(sequences[i], dtype=torch.long)
                segments[r, start: start + n] = k + 1
                spans.append((i, r, start, n))
                start += n
        packed = any(len(row) > 1 for row in rows)
        out.append(MicroBatch(tokens, segments if packed else None, spans))
    return out
