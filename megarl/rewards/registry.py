"""Look up a reward function by import path ("package.module:function"), as `trainer.reward` names it."""

from __future__ import annotations

import functools
import math
import numbers
import reprlib
from collections.abc import Callable, Collection, Mapping

from megarl.config.imports import import_spec
from megarl.errors import UserError
from megarl.rewards.text import reads_tool_turns

RewardFn = Callable[[list[str], list[str]], list[float]]
"""fn(completions, answers) -> one score per completion."""


def load_reward(spec: str, field: str = "trainer.reward") -> RewardFn:
    """Import `module:function` and return the function; a UserError naming ``field`` otherwise."""
    where = f"{field} = {spec!r}"
    module, attr = import_spec(spec, where, "function")
    if not hasattr(module, attr):
        public = sorted(name for name, value in vars(module).items() if callable(value) and not name.startswith("_"))
        raise UserError(
            f"{where}: module {module.__name__!r} has no attribute {attr!r}. Fix: use one of its functions: {public}."
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise UserError(
            f"{where}: {module.__name__}.{attr} is a {type(fn).__name__}, not a function. Fix: name a function "
            "fn(completions: list[str], answers: list[str]) -> list[float]."
        )
    return _named(fn, where)


def _named(fn: RewardFn, where: str) -> RewardFn:
    """``fn``, with an exception it raises turned into one paragraph naming the field that set it."""

    @functools.wraps(fn)
    def reward(completions: list[str], answers: list[str]) -> list[float]:
        try:
            scores = fn(completions, answers)
        except Exception as err:
            raise UserError(f"{where} raised {type(err).__name__}: {err} (scoring {len(completions)} completions). "
                            "Fix: make it return a score for every completion, e.g. 0.0 for one it cannot parse; "
                            "MEGARL_DEBUG=1 shows the traceback.") from err
        # here, before a rank's or a worker's share is gathered and sliced (a None would fail there, unnamed)
        return checked_scores(scores, len(completions), where)

    reward.reads_tool_turns = reads_tool_turns(fn)  # type: ignore[attr-defined]  # wraps copies an instance's only
    reward.where = where  # type: ignore[attr-defined]  # for the callers' own checks (megarl.eval.harness)
    return reward


FIX = "Fix: return one finite float (or int/bool) per completion, in the completions' order."


def checked_scores(scores: object, count: int, where: str) -> list[float]:
    """``scores`` as ``count`` floats, else a UserError naming ``where`` (e.g. "trainer.reward = 'm:fn'") and what
    came back: a None or a string fails later as a traceback, and a NaN averages into the metrics silently."""
    listed: list[object] | None = None
    if isinstance(scores, Collection) and not isinstance(scores, (str, bytes, Mapping)):
        try:  # a 0-d array or tensor is a Collection whose iteration raises
            listed = list(scores)
        except TypeError:
            pass
    if listed is None:
        raise UserError(f"{where} returned {_shown(scores)} for {count} completions. {FIX}")
    if len(listed) != count:
        raise UserError(f"{where} returned a {type(scores).__name__} of {len(listed)} for {count} completions. {FIX}")
    floats = []
    for i, value in enumerate(listed):
        try:  # numbers, numpy's and torch's scalars; never text, which float() would read
            number = float(value) if not isinstance(value, (str, bytes)) else math.nan  # type: ignore[arg-type]
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise UserError(f"{where} returned {_shown(value)} for sample {i} of the {count} completions it scored. "
                            f"{FIX}")
        floats.append(number)
    return floats


def _shown(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, numbers.Real):
        return str(float(value))
    return f"{reprlib.repr(value)} (a {type(value).__name__})"
