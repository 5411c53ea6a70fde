"""The configuration reference in Markdown, generated from the config dataclasses' field docstrings.

  python -m megarl.config.reference            # print it
  python -m megarl.config.reference --update   # rewrite docs/configuration.md between the markers

tests/test_config_reference.py keeps docs/configuration.md's copy current.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path

from megarl.config import Config
from megarl.config.reward_training import RewardTrainingConfig
from megarl.config.yaml_io import field_docs

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
REFERENCE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _type_name(tp: object) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and len(args) < len(typing.get_args(tp)):
        return _type_name(args[0]) + " or null"
    if len(args) > 1:
        return " or ".join(_type_name(a) for a in args)
    return getattr(tp, "__name__", str(tp))


def _default(field: dataclasses.Field, defaults: object | None) -> str:
    """A field's default as its section's default instance holds it (``defaults``: None where the section has
    required fields), so that a section made by a factory with values of its own (critic.optimizer's lr) shows
    them, not its class's."""
    if defaults is not None and field.default is not None:  # a null default resolved at construction stays null
        value = getattr(defaults, field.name)
    elif field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "**required**"
    if value is None:
        return "`null`"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if isinstance(value, list) and not all(isinstance(x, str) for x in value):
        return "`[]`" if not value else "(list)"
    # a table cell ends at any unescaped "|", code spans included (GitHub's tables)
    return f"`{value!r}`".replace("|", "\\|")


def _made(field: dataclasses.Field, defaults: object | None) -> object | None:
    """The default instance of a section field: its parent's, or its factory's (None where it has required
    fields)."""
    if defaults is not None:
        return getattr(defaults, field.name)
    if field.default_factory is dataclasses.MISSING:  # type: ignore[misc]
        return None
    try:
        return field.default_factory()  # type: ignore[misc]
    except TypeError:  # a section with required fields
        return None


def _rows(cls: type, prefix: str, hints: dict[str, object], defaults: object | None = None) -> list[str]:
    rows = []
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            rows += _rows(tp, f"{prefix}{field.name}.", typing.get_type_hints(tp),  # type: ignore[arg-type]
                          _made(field, defaults))
            continue
        optional = [a for a in typing.get_args(tp) if a is not type(None)]
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        if union and len(optional) == 1 and dataclasses.is_dataclass(optional[0]):  # optional section: null = off
            rows.append(f"| `{prefix}{field.name}` | section or null | {_default(field, defaults)} | "
                        f"{docs.get(field.name, '')} |")
            rows += _rows(optional[0], f"{prefix}{field.name}.",  # type: ignore[arg-type]
                          typing.get_type_hints(optional[0]))
            continue
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(item):
            rows.append(f"| `{prefix}{field.name}` | list | {_default(field, defaults)} | "
                        f"{docs.get(field.name, '')} |")
            rows += _rows(item, f"{prefix}{field.name}[].", typing.get_type_hints(item))  # type: ignore[arg-type]
            continue
        rows.append(f"| `{prefix}{field.name}` | {_type_name(tp)} | {_default(field, defaults)} | "
                    f"{docs.get(field.name, '')} |")
    return rows


def _sections(root: type, names: list[str], heading: str) -> list[str]:
    out: list[str] = []
    hints = typing.get_type_hints(root)
    for name in names:
        section = hints[name]
        out += ["", heading.format(name=name), "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        out += _rows(section, f"{name}.", typing.get_type_hints(section),  # type: ignore[arg-type]
                     _made(next(f for f in dataclasses.fields(root) if f.name == name), None))
    return out


def reference() -> str:
    out = ["Every recipe key, its type, default and meaning (generated by `python -m megarl.config.reference`)."]
    out += _sections(Config, [f.name for f in dataclasses.fields(Config)], "#### `{name}`")
    rl = typing.get_type_hints(Config)
    rm = typing.get_type_hints(RewardTrainingConfig)
    own = [f.name for f in dataclasses.fields(RewardTrainingConfig) if rm[f.name] is not rl.get(f.name)]
    shared = [f"`{f.name}`" for f in dataclasses.fields(RewardTrainingConfig) if f.name not in own]
    out += ["", "#### Reward-model training", "", f"A recipe of `python -m megarl.train_rm` ([reward models]"
            f"(reward_models.md#training-a-reward-model)) has {', '.join(shared)} as above, and sections of its own:"]
    out += _sections(RewardTrainingConfig, own, "##### `train_rm` `{name}`")
    return "\n".join(out)


def updated_page(text: str) -> str:
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{reference()}\n{END}{tail}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        REFERENCE_PAGE.write_text(updated_page(REFERENCE_PAGE.read_text()))
    else:
        print(reference())
