"""Preference pairs for reward-model training: a prompt, the response preferred, and the one rejected.

One JSON object per line, in one of these forms:
  {"prompt": "...", "chosen": "...", "rejected": "..."}        text, or lists of chat messages, for each
  {"chosen": [messages], "rejected": [messages]}                 two whole conversations (HH-RLHF's form): the
                                                                 prompt is the turns they share
  {"prompt_ids": [...], "chosen_ids": [...], "rejected_ids": [...]}
                                                                 token ids, as the policy sampled them (pairs
                                                                 made of its own samples: no text to re-render)
Each text pair becomes chat messages, which the reward model's own tokenizer and chat template render.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.data.prompts import read_jsonl, read_parquet
from megarl.errors import UserError

Messages = list[dict[str, str]]
_EXAMPLE = '{"prompt": "2+2?", "chosen": "4", "rejected": "5"}'
IDS = ("prompt_ids", "chosen_ids", "rejected_ids")


@dataclass(frozen=True, slots=True)
class PreferencePair:
    prompt: Messages
    """The conversation up to the responses (ending in a user turn, as a policy's prompt does)."""
    chosen: Messages
    """The preferred response's turns (one assistant message for a single-turn response)."""
    rejected: Messages
    source: str
    """Where the pair came from ("FILE line N"), for errors found after reading."""
    ids: tuple[list[int], list[int], list[int]] | None = None
    """A pair given as token ids: (prompt, chosen, rejected); the messages are then empty."""


def load_pairs(path: str, field: str = "data.train_path") -> list[PreferencePair]:
    """The pairs of a .jsonl or .parquet file; bad input is a UserError naming ``field``, the line and the fix."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{field} = {path!r}: no such file. Fix: give a .jsonl file of preference pairs, one per "
                        f"line, like {_EXAMPLE}.")
    if file.suffix not in (".jsonl", ".parquet"):
        raise UserError(f"{field} = {path!r} has suffix {file.suffix!r}. Fix: convert it to .jsonl (one JSON object "
                        f"per line, like {_EXAMPLE}) or .parquet.")
    rows = read_jsonl(file, field) if file.suffix == ".jsonl" else read_parquet(file, field)
    pairs = [_pair(row, where, field) for where, row in rows]
    if not pairs:
        raise UserError(f"{field} = {path!r} holds no pairs. Fix: point it at a non-empty file.")
    return pairs


def _messages(value: Any, where: str, key: str, field: str, role: str) -> Messages:
    """Text as one message of ``role``, or a list of {"role", "content"} messages, checked."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    ok = isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise UserError(f"{field} {where}: {key!r} is {type(value).__name__} {str(value)[:80]!r}, not text or a "
                        'non-empty list of {"role": ..., "content": ...} messages. Fix: write it as one of those.')
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _pair(row: Any, where: str, field: str) -> PreferencePair:
    if not isinstance(row, dict):
        raise UserError(f"{field} {where} is a JSON {type(row).__name__}, not an object. Fix: write pairs like "
                        f"{_EXAMPLE}.")
    if any(k in row for k in IDS):
        return _ids_pair(row, where, field)
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise UserError(f"{field} {where} has no key {missing[0]!r}; its keys are {sorted(row)}. Fix: write pairs "
                        f"like {_EXAMPLE}.")
    if "prompt" in row:
        prompt = _messages(row["prompt"], where, "prompt", field, "user")
        chosen = _messages(row["chosen"], where, "chosen", field, "assistant")
        rejected = _messages(row["rejected"], where, "rejected", field, "assistant")
    else:  # two whole conversations: the prompt is what they share, up to the first turn where they differ
        whole_c = _messages(row["chosen"], where, "chosen", field, "assistant")
        whole_r = _messages(row["rejected"], where, "rejected", field, "assistant")
        shared = 0
        while shared < min(len(whole_c), len(whole_r)) and whole_c[shared] == whole_r[shared]:
            shared += 1
        prompt, chosen, rejected = whole_c[:shared], whole_c[shared:], whole_r[shared:]
        if not prompt or not chosen or not rejected:
            raise UserError(f"{field} {where}: without a 'prompt' key, 'chosen' and 'rejected' must be two "
                            "conversations that share their first turns (the prompt) and then differ; these "
                            f"share {shared} of {len(whole_c)} and {len(whole_r)}. Fix: add a 'prompt' key, or give "
                            "both conversations whole.")
    for key, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[0]["role"] != "assistant":
            raise UserError(f"{field} {where}: the {key} response starts with a {turns[0]['role']!r} turn, not the "
                            "assistant's. Fix: give the response as the assistant's text or turns after the prompt.")
    if prompt[-1]["role"] == "assistant":
        raise UserError(f"{field} {where}: the prompt ends with an assistant turn; a response must follow the user's. "
                        "Fix: end the prompt with a user turn.")
    if chosen == rejected:
        raise UserError(f"{field} {where}: 'chosen' and 'rejected' are the same response, which teaches nothing. "
                        "Fix: remove the pair.")
    return PreferencePair(prompt, chosen, rejected, where)


def _ids_pair(row: dict[str, Any], where: str, field: str) -> PreferencePair:
    for key in IDS:
        if key not in row:
            raise UserError(f"{field} {where} has no key {key!r}; its keys are {sorted(row)}. Fix: give all of "
                            f"{', '.join(IDS)} as lists of token ids.")
        value = row[key]
        if not (isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in value)):
            raise UserError(f"{field} {where}: {key!r} is {str(value)[:80]!r}, not a non-empty list of token ids. "
                            f"Fix: give all of {', '.join(IDS)} as lists of non-negative integers.")
    prompt, chosen, rejected = (list(row[k]) for k in IDS)
    if chosen == rejected:
        raise UserError(f"{field} {where}: 'chosen_ids' and 'rejected_ids' are the same response, which teaches "
                        "nothing. Fix: remove the pair.")
    return PreferencePair([], [], [], where, (prompt, chosen, rejected))
