"""An LLM judge's part of a sample's reward (reward_model.judge): the prompt it is asked, and its verdict read as a
score by a named parse function. The engine side is megarl.loop.judge_phase.

A verdict the parse function cannot read (it returns None, or a NaN/inf) scores ``unparsable_score`` and is counted;
a parse function that raises stops the run with an error naming it: a bug in it is not a verdict.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from megarl.config.imports import import_spec
from megarl.errors import UserError

ParseFn = Callable[[str], "float | None"]
"""fn(verdict text) -> its score, or None when it holds none."""

NUMBER_RE = re.compile(r"[-+]?\d+(?:\.\d+)?")


def first_number(verdict: str) -> float | None:
    """The first number in the verdict ("Rating: 7/10" -> 7.0), or None when it has none."""
    found = NUMBER_RE.search(verdict)
    return float(found.group()) if found else None


def first_digit(verdict: str) -> float | None:
    """The verdict's first digit, for a 0-9 rating ("Rating: 7" -> 7.0, "85" -> 8.0), or None when it has none."""
    found = re.search(r"\d", verdict)
    return float(found.group()) if found else None


def judge_text(template: str, prompt: str, response: str, answer: str | None) -> str:
    """The judge's user turn for one sample."""
    return template.format(prompt=prompt, response=response, answer=answer or "")


def render(text: str, tokenizer: Any, apply_chat_template: bool) -> list[int]:
    """The judge's token ids of its user turn: through its chat template, as a user turn followed by the assistant's
    header, when asked and its tokenizer has one; else the text as it is."""
    if apply_chat_template and getattr(tokenizer, "chat_template", None) is not None:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                add_generation_prompt=True, return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer(text)["input_ids"])


def load_parse(spec: str, field: str = "reward_model.judge.parse") -> ParseFn:
    """Import the parse function ``spec`` ("module:function"); a UserError naming ``field`` otherwise."""
    where = f"{field} = {spec!r}"
    module, attr = import_spec(spec, where, "function")
    fn = getattr(module, attr, None)
    if not callable(fn):
        what = "has no such attribute" if fn is None else f"is a {type(fn).__name__}, not a function"
        raise UserError(f"{where}: {module.__name__}.{attr} {what}. Fix: name a function fn(verdict: str) -> "
                        "float | None (None for a verdict it cannot read).")
    return fn  # type: ignore[no-any-return]


def parse_verdicts(verdicts: Sequence[str], parse: ParseFn, spec: str, unparsable_score: float
                   ) -> tuple[list[float], list[bool]]:
    """Each verdict's score, and whether it was unparsable (then ``unparsable_score``). A parse function that raises,
    or returns something other than a number or None, stops the run with one paragraph naming ``spec``."""
    scores, unparsable = [], []
    for verdict in verdicts:
        try:
            value = parse(verdict)
        except Exception as err:
            raise UserError(f"reward_model.judge.parse = {spec!r} raised {type(err).__name__}: {err} on the verdict "
                            f"{verdict[:200]!r}. Fix: make it return None for a verdict it cannot read (the sample "
                            "then scores reward_model.judge.unparsable_score); MEGARL_DEBUG=1 shows the traceback."
                            ) from err
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise UserError(f"reward_model.judge.parse = {spec!r} returned {value!r} ({type(value).__name__}) for the "
                            f"verdict {verdict[:200]!r}. Fix: make it return a float, or None for a verdict it cannot "
                            "read.")
        bad = value is None or not math.isfinite(value)
        scores.append(unparsable_score if bad else float(value))  # type: ignore[arg-type]
        unparsable.append(bad)
    return scores, unparsable
