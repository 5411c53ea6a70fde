"""Look up a reward function by import path ("package.module:function"), as `trainer.reward` names it."""

from __future__ import annotations

import functools
from collections.abc import Callable

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
            return fn(completions, answers)
        except Exception as err:
            raise UserError(f"{where} raised {type(err).__name__}: {err} (scoring {len(completions)} completions). "
                            "Fix: make it return a score for every completion, e.g. 0.0 for one it cannot parse; "
                            "MEGARL_DEBUG=1 shows the traceback.") from err

    reward.reads_tool_turns = reads_tool_turns(fn)  # type: ignore[attr-defined]  # wraps copies an instance's only
    return reward
