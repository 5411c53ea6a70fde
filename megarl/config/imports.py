"""Objects named by import path ("package.module:name"), as configs name rewards and tools."""

from __future__ import annotations

import importlib
from types import ModuleType

from megarl.errors import UserError


def import_spec(spec: str, where: str, kind: str) -> tuple[ModuleType, str]:
    """The module of ``spec`` and the name after its colon; one UserError paragraph starting with ``where`` when
    the spec is malformed or its module does not import. ``kind`` names what the spec should point at."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f'{where} is not an import path. Fix: write it as "package.module:{kind}".')
    try:
        return importlib.import_module(module_name), attr
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name + ".").startswith(err.name + "."):
            raise UserError(
                f"{where}: no module named {err.name!r} can be imported. Fix: check the spelling, or make the "
                "module importable (install its package or add its directory to PYTHONPATH)."
            ) from err
        raise UserError(
            f"{where}: importing module {module_name!r} failed because it needs {err.name!r}, which is not "
            f"installed. Fix: install the package that provides {err.name!r}."
        ) from err
    except Exception as err:
        raise UserError(
            f"{where}: importing module {module_name!r} failed: it raised {type(err).__name__}: {err}. Fix: correct "
            "that module (MEGARL_DEBUG=1 shows the traceback)."
        ) from err
