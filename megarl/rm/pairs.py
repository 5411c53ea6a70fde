"""Preference pairs as token ids: each conversation rendered as RL's reward phase renders a sample
(megarl.data.conversation), so that the reward model trains on what it will score. With the chat template: the
prompt's turns with the assistant header (add_generation_prompt), then the response's text and the EOS token, where
a sample stops; without it: the prompt as plain text (turns joined by blank lines, with the tokenizer's BOS), then
the response and the EOS. (data.end_with_eos: false leaves the EOS to the response's text, for pairs of samples a
token budget cut.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megarl.data.conversation import end_token_id, render_conversation
from megarl.data.preferences import Messages, PreferencePair
from megarl.errors import UserError


@dataclass(frozen=True, slots=True)
class TokenizedPair:
    chosen: list[int]
    rejected: list[int]
    source: str


def conversation_ids(prompt: Messages, response: Messages, tokenizer: Any, chat_template: bool, eos: bool,
                     source: str) -> list[int]:
    """The token ids of ``prompt`` then ``response`` (one assistant turn) as RL's reward phase renders a sample
    (megarl.data.conversation), ending in the end token with ``eos``."""
    if len(response) != 1:
        raise UserError(f"{source}: the response has {len(response)} turns; reward-model training takes one "
                        "assistant turn per response. Fix: keep the earlier turns in the prompt.")
    return render_conversation(prompt, response[0]["content"], tokenizer, chat_template, eos)


def pad_end_note(tokenizer: Any, pad: int | None, eos: bool) -> str | None:
    """With ``eos`` (data.end_with_eos), a model whose pad token (config.json's pad_token_id) is the end token is
    scored before that token: transformers' sequence classification reads the last token that is not the pad
    token, and megarl reads where an exported model will (megarl.models.reward_model.last_position), so every
    response is scored as if it had no end token. Llama and Mistral fine-tunes often set pad to EOS."""
    end = end_token_id(tokenizer)
    if not eos or end is None or pad != end:
        return None
    return (f"megarl: warning: data.end_with_eos = true appends {tokenizer.convert_ids_to_tokens(end)!r} (id {end}), "
            "which is also the model's pad_token_id (config.json): a conversation is scored at its last token that "
            "is not the pad token, as transformers scores the exported model, so the end token is never read and a "
            "finished response scores as a cut one. Fix: give the model a pad token of its own (pad_token_id in "
            "model.hf_path's config.json and the tokenizer's pad_token, e.g. an unused reserved token), or set "
            "data.end_with_eos: false, which trains on the tokens the scores read now.")


def tokenize_pairs(pairs: Sequence[PreferencePair], tokenizer: Any, chat_template: bool, eos: bool, max_tokens: int,
                   drop_long: bool, vocab: int, field: str) -> tuple[list[TokenizedPair], int]:
    """The pairs as ids, and how many were dropped for a conversation longer than ``max_tokens`` (with
    ``drop_long``; otherwise a UserError naming ``field``, the count and the longest). A pair whose two
    conversations are the same ids teaches nothing and is refused, and so is an id past the model's ``vocab``
    embedding rows."""
    out, long = [], []
    for p in pairs:
        if p.ids is not None:
            prompt, chosen, rejected = p.ids
            largest = max(prompt + chosen + rejected)
            if largest >= vocab:
                raise UserError(f"{p.source}: token id {largest} is past the model's {vocab} embedding rows "
                                "(vocab_size of model.hf_path's config.json). Fix: give ids of its vocabulary.")
            chosen, rejected = prompt + chosen, prompt + rejected
        else:
            chosen = conversation_ids(p.prompt, p.chosen, tokenizer, chat_template, eos, p.source)
            rejected = conversation_ids(p.prompt, p.rejected, tokenizer, chat_template, eos, p.source)
        if chosen == rejected:
            raise UserError(f"{p.source}: chosen and rejected are the same tokens once rendered (they differ only in "
                            "what the tokenizer drops). Fix: remove the pair.")
        if max(len(chosen), len(rejected)) > max_tokens:
            long.append((max(len(chosen), len(rejected)), p.source))
            continue
        out.append(TokenizedPair(chosen, rejected, p.source))
    if long and not drop_long:
        longest, where = max(long)
        raise UserError(f"{field}: {len(long)} of {len(pairs)} pairs have a conversation longer than "
                        f"data.max_tokens = {max_tokens} tokens (the longest, {longest}, at {where}). Fix: raise "
                        "data.max_tokens, or set data.drop_long: true to skip them.")
    if not out:
        raise UserError(f"{field}: no pair is left ({len(long)} longer than data.max_tokens = {max_tokens}). Fix: "
                        "raise data.max_tokens.")
    return out, len(long)
