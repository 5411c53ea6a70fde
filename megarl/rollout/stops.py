"""The tokens that end a sample: the model's own EOS ids and the run's stop ids.

Engines order their finish checks differently: vLLM looks for a stop token first, SGLang for an abort and then
for the token budget, so a sample whose last token is EOS comes back "length" (its budget or a chunk's ran out on
that token) or "abort" (the one token an aborted request keeps). A sample ending in one of these tokens is
complete, whatever reason the engine gave.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path


def model_eos_ids(hf_dir: str | Path) -> tuple[int, ...]:
    """The EOS ids a sample ends at besides the requested stop ids (``eos_token_id``: an int, a list or null):
    generation_config.json's, then config.json's. SGLang stops at both files' ids; vLLM and transformers at
    generation_config.json's where it names any: megarl asks every engine to stop at all of them, so that a sample
    ends at the same token whichever engine made it, and a sample ending in one is complete (``ends_in_stop``). A
    file that is missing or unreadable adds nothing (the tokenizer's EOS is still asked for)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((Path(hf_dir) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, int) and not isinstance(x, bool) and x >= 0 and x not in ids:
                ids.append(x)
    return tuple(ids)


def sample_stop_ids(eos_token_id: int | None, hf_dir: str | Path) -> tuple[int, ...]:
    """What every engine is asked to stop at, in training and in evaluation alike: the tokenizer's EOS and the
    model's own (``model_eos_ids``). An evaluation that stopped at the tokenizer's alone ran past an EOS that only
    config.json names on vLLM, where training's samples end."""
    return tuple(dict.fromkeys(((eos_token_id,) if eos_token_id is not None else ()) + model_eos_ids(hf_dir)))


def ends_in_stop(tokens: Sequence[int], stop_ids: Collection[int]) -> bool:
    """Whether a sample's last token is one that ends it (so its finish reason is "stop")."""
    return bool(tokens) and tokens[-1] in stop_ids
