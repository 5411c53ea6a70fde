"""The model directory's tokenizer, checked before anything is built: transformers quietly builds an empty
tokenizer from a directory without vocabulary files, and every prompt then encodes to no tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.errors import UserError

VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken")
"""A tokenizer needs one of these; tokenizer_config.json alone names a class but holds no vocabulary."""


def check_hf_config(hf_dir: str, field: str = "model.hf_path") -> None:
    """transformers' own validation of config.json (it also runs inside the engines, which would fail later)."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(hf_dir)
    except Exception as err:  # transformers raises ValueError, OSError or huggingface_hub's validation errors
        raise UserError(f"{field} = {hf_dir!r}: transformers rejects {Path(hf_dir) / 'config.json'}: "
                        f"{' '.join(str(err).split())}. Fix: correct that field of config.json, or re-download "
                        "the model.") from None


def load_tokenizer(hf_dir: str, field: str = "model.hf_path") -> Any:
    """The tokenizer of ``hf_dir``, after checking its config.json and that it has a vocabulary."""
    check_hf_config(hf_dir, field)
    directory = Path(hf_dir)
    if not any(next(directory.glob(pattern), None) for pattern in VOCABULARY_FILES):
        raise UserError(f"{field} = {hf_dir!r} has no tokenizer: none of {', '.join(VOCABULARY_FILES)} is there. "
                        "Fix: copy the tokenizer files of the model (tokenizer.json and tokenizer_config.json, "
                        "from the same release as its weights) into that directory.")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    except Exception as err:  # a damaged tokenizer.json surfaces as an exception of the tokenizers library
        raise UserError(f"{field} = {hf_dir!r}: its tokenizer does not load ({' '.join(str(err).split())}). "
                        "Fix: copy the tokenizer files of the model into that directory again.") from None
    if not tokenizer("a 1")["input_ids"]:
        raise UserError(f"{field} = {hf_dir!r}: its tokenizer encodes text to no tokens (vocabulary of "
                        f"{len(tokenizer)}). Fix: copy the tokenizer files of the model into that directory again.")
    return tokenizer


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """Token ids to the text a reward reads: special tokens (the end of turn) left out."""

    def decode(tokens: list[int]) -> str:
        return str(tokenizer.decode(tokens, skip_special_tokens=True))

    return decode
