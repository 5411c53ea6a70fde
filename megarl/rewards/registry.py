"""Look up a reward function by import path ("package.module:function"), as `trainer.reward` names it."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from megarl.errors import UserError

RewardFn = Callable[[list[str], list[str]], list[float]]
"""fn(completions, answers) -> one score per completion."""


def load_reward(spec: str, field: str = "trainer.reward") -> RewardFn:
    """Import `module:function` and return the function; a UserError naming ``field`` otherwise."""
    where = f"{field} = {spec!r}"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f'{where} is not an import path. Fix: write it as "package.module:function".')
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name + ".").startswith(err.name + "."):
            raise UserError(
                f"{where}: no module named {err.name!r} can be imported. Fix: check the spelling, or make the "
                "module importable (install its package or add its directory to PYTHONPATH)."
            ) from err
        raise UserError(
            f"{where}: importing {module_name!r} failed because it needs {err.name!r}, which is not installed. "
            f"Fix: install the package that provides {err.name!r}."
        ) from err
    except Exception as err:
        raise UserError(
            f"{where}: importing {module_name!r} raised {type(err).__name__}: {err}. Fix: correct that module "
            "(MEGARL_DEBUG=1 shows the traceback)."
        ) from err
    if not hasattr(module, attr):
        public = sorted(name for name, value in vars(module).items() if callable(value) and not name.startswith("_"))
        raise UserError(
            f"{where}: module {module_name!r} has no attribute {attr!r}. Fix: use one of its functions: {public}."
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise UserError(
            f"{where}: {module_name}.{attr} is a {type(fn).__name__}, not a function. Fix: name a function "
            "fn(completions: list[str], answers: list[str]) -> list[float]."
        )
    return fn
