"""A conversation as a reward model reads it, rendered by one function for reward-model training (megarl.rm.pairs)
and for RL's scoring with a tokenizer other than the policy's (megarl.rewards.reward_model): a reward model scores
a conversation at its last token, so a run that rendered the end of it differently from training (a chat
template's newline after the end of turn, an end token on a response the token budget cut) would score it where
it never learned to.

The rendering is the one a policy's sample has: the prompt as the policy reads it (megarl.data.batching: the chat
template with the assistant header, or the turns' text joined by blank lines with the tokenizer's BOS), then the
response's text encoded on its own, then the tokenizer's EOS where the response stopped and only there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def render_conversation(prompt: Sequence[dict[str, str]], response: str, tokenizer: Any, chat_template: bool,
                        finished: bool) -> list[int]:
    """The token ids of ``prompt`` (chat messages) then ``response`` (the assistant's text), ending in the end
    token (``end_token_id``) when ``finished``."""
    if chat_template and tokenizer.chat_template is not None:
        ids = list(tokenizer.apply_chat_template(list(prompt), tokenize=True, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"])
    else:
        ids = list(tokenizer("\n\n".join(m["content"] for m in prompt))["input_ids"])
    ids += tokenizer.encode(response, add_special_tokens=False)
    end = end_token_id(tokenizer)
    return ids + [end] if finished and end is not None else ids


def end_token_id(tokenizer: Any) -> int | None:
    """The token a finished response ends with: the tokenizer's EOS, one the policy's engine stops at when both
    share the tokenizer (megarl.loop.bootstrap.stop_ids), so that both paths of RL give the same ids for a sample
    that stopped there (generation_config.json may add other stop ids, which the shared path keeps as sampled)."""
    eos = tokenizer.eos_token_id
    return int(eos) if eos is not None else None
