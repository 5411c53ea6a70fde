"""Tool output made inert: text that spells one of the tokenizer's added tokens (<|im_end|>, the EOS, chat
delimiters) would be encoded as that token, so a tool's output could end the sample or forge a turn. Each
occurrence is split with a zero-width space after its first character, so it is encoded as ordinary text; the
model still reads the same characters."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_SPLIT = "\u200b"


class InertText:
    """`inert(text)`: `text` with every occurrence of `tokens` split (one-character tokens become U+FFFD)."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self.tokens = sorted({t for t in tokens if t}, key=len, reverse=True)  # the longest first, as tokenizers
        self._pattern = re.compile("|".join(map(re.escape, self.tokens))) if self.tokens else None

    def __call__(self, text: str) -> str:
        if self._pattern is None:
            return text
        # a split can bring two halves of another token together ("<|im_" + "<|im_end|>"): repeat until none
        while True:
            split = self._pattern.sub(lambda m: m[0][0] + _SPLIT + m[0][1:] if len(m[0]) > 1 else "\ufffd", text)
            if split == text:
                return text
            text = split

    @classmethod
    def of(cls, tokenizer: Any) -> InertText:
        """For a Hugging Face tokenizer: every added token (special or not, all are matched whole before the
        model's own vocabulary) and the special tokens it names."""
        added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
        return cls([*added, *getattr(tokenizer, "all_special_tokens", [])])
