"""YAML -> typed dataclasses: reading, `--set` overrides, type checking, and field-naming errors.

Generic over any tree of `@dataclass(kw_only=True, slots=True)` classes whose fields are bool, int, float,
str, Literal of strings, `X | None`, or a nested dataclass. The dataclasses themselves live in config.py.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import itertools
import json
import re
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from megarl.errors import UserError

T = TypeVar("T")

# YAML 1.1 (PyYAML) reads `1e-6` as a string because it wants a dot before the exponent; people
# write it anyway, so float fields accept any string that is a plain decimal/scientific number.
_FLOAT_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_KEY_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class FieldError(UserError):
    """A bad config value. `field` is dotted and relative to the dataclass that raised it.

    `__post_init__` checks only know their own field names; `build` prefixes the section path as the
    error travels up, and the loader adds where the key was set (file line or `--set` flag).
    """

    def __init__(self, field: str, detail: str, origin: str | None = None) -> None:
        self.field = field
        self.detail = detail
        self.origin = origin
        where = f" ({origin})" if origin else ""
        super().__init__(f"config key `{field}`{where} {detail}")

    def under(self, prefix: str) -> FieldError:
        return FieldError(f"{prefix}.{self.field}" if prefix else self.field, self.detail, self.origin)


def show(value: object) -> str:
    """Render a value as the user wrote it in YAML (true/null, quoted strings)."""
    return json.dumps(value, default=str)


def check(ok: bool, field: str, value: object, must: str, fix: str) -> None:
    """Raise FieldError unless `ok`: `<field> = <value>, but it must <must>. Fix: <fix>.`"""
    if not ok:
        raise FieldError(field, f"= {show(value)}, but it must {must}. Fix: {fix}.")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass and its bases (the string literal under each field)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[:-1]):
        docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # source not shipped (zipapp, frozen): messages just omit the description
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _type_error(path: str, value: object, tp: type, nullable: bool) -> FieldError:
    expected = _TYPE_NAMES[tp] + (" or null" if nullable else "")
    if isinstance(value, str) and tp in (int, float) and _FLOAT_RE.fullmatch(value):
        fix = "remove the quotes around the number"
    elif value is None:
        fix = f"set {expected}, or delete the key to use the default"
    elif isinstance(value, bool) and tp in (int, float):
        fix = f"booleans are not numbers here; set {expected}"
    elif tp is str and isinstance(value, int | float | bool):
        fix = f"quote it to make it a string: {show(str(value))}"
    else:
        fix = f"set {expected}"
    return FieldError(path, f"= {show(value)} has the wrong type: it must be {expected}. Fix: {fix}.")


def _convert(value: object, tp: Any, path: str, nullable: bool = False) -> object:
    if dataclasses.is_dataclass(tp):
        return build(typing.cast(type, tp), value, path)
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        inner = [a for a in get_args(tp) if a is not type(None)]
        nullable = len(inner) < len(get_args(tp))
        if len(inner) == 1:
            return _convert(value, inner[0], path, nullable=True)
        for candidate in inner:  # e.g. float | Literal["auto"]: the first that takes the value
            try:
                return _convert(value, candidate, path, nullable)
            except FieldError:
                continue
        expected = " or ".join(f"`{get_args(a)[0]}`" if get_origin(a) is Literal else _TYPE_NAMES.get(a, str(a))
                               for a in inner)
        raise FieldError(path, f"= {show(value)} has the wrong type: it must be {expected}. Fix: set {expected}.")
    if origin is list:
        if isinstance(value, list):
            return [_convert(item, get_args(tp)[0], f"{path}[{i}]") for i, item in enumerate(value)]
        raise FieldError(path, f"= {show(value)} must be a list. Fix: write `{path.rsplit('.', 1)[-1]}:` followed by "
                               "indented `- ` items.")
    if origin is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise FieldError(path, f"= {show(value)} must be a mapping of names to values. Fix: write `"
                               f"{path.rsplit('.', 1)[-1]}:` followed by indented `name: value` lines.")
    if origin is Literal:
        choices = [str(a) for a in get_args(tp)]
        if isinstance(value, str) and value in choices:
            return value
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            return "on" if value else "off"  # YAML 1.1 reads an unquoted on/off as a boolean
        close = difflib.get_close_matches(str(value), choices, n=1)
        fix = f"use {show(close[0])}" if close else "use one of them"
        if nullable:
            choices.append("null")
        raise FieldError(path, f"= {show(value)} is not one of {', '.join(choices)}. Fix: {fix}.")
    # bool is a subclass of int in Python, so every numeric branch excludes it explicitly.
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)
    if tp is str and isinstance(value, str):
        return value
    if tp not in _TYPE_NAMES:
        raise TypeError(f"config annotation {tp!r} of `{path}` is not supported by megarl.config.yaml_io")
    raise _type_error(path, value, tp, nullable)


def _initials(name: str) -> str:
    return "".join(part[:1] for part in name.split("_"))


def _closest(key: str, names: Sequence[str]) -> str | None:
    # Abbreviations (`tp` for tensor_parallel, `learning_rate` for lr) are too short for difflib.
    close = difflib.get_close_matches(key, names, n=1) or [
        n for n in names if key == _initials(n) or _initials(key) == n
    ]
    return close[0] if close else None


def _unknown_key(cls: type, key: str, path: str) -> FieldError:
    names = [f.name for f in dataclasses.fields(cls)]
    hints = typing.get_type_hints(cls)
    # A key one level too high (`actor.lr` for `actor.optimizer.lr`) is the other common slip.
    deeper = [
        f"{f.name}.{match}"
        for f in dataclasses.fields(cls)
        if dataclasses.is_dataclass(hints[f.name])
        and (match := _closest(key, [g.name for g in dataclasses.fields(hints[f.name])]))
    ]
    exact = [d for d in deeper if d.endswith(f".{key}")]  # `actor.lr`: optimizer.lr before a near name (lora)
    close = exact[0] if exact else _closest(key, names) or (deeper[0] if deeper else None)
    refused = getattr(cls, "REFUSED_KEYS", {}).get(key)  # a key known to be wrong here, with its reason
    if refused:
        hint = refused
    elif close:
        hint = f"did you mean `{close}`?"
    elif "." in key:
        hint = "dotted keys are for --set; in YAML, nest each part as an indented section."
    else:
        hint = "remove it or fix the spelling."
    return FieldError(path, f"is not a field of {cls.__name__}; {hint} Valid: {', '.join(names)}.")


def build(cls: type[T], data: object, path: str = "") -> T:
    """Build dataclass `cls` from a parsed-YAML mapping, checking keys and types; errors name `path`.

    A section written as an empty key (`critic:` with everything below commented out) is null in YAML;
    it means "all defaults", not "no section".
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        names = ", ".join(f.name for f in dataclasses.fields(typing.cast(Any, cls)))
        raise FieldError(
            path or "<top level>",
            f"= {show(data)} must be a mapping (a section with keys such as {names}). "
            f"Fix: write `{path.rsplit('.', 1)[-1] or 'key'}:` followed by indented `key: value` lines.",
        )
    prefix = f"{path}." if path else ""
    fields = {f.name: f for f in dataclasses.fields(typing.cast(Any, cls))}
    for key in data:
        if not isinstance(key, str) or key not in fields:
            raise _unknown_key(cls, str(key), prefix + str(key))
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, object] = {}
    for name, f in fields.items():
        if name in data:
            retired = f.metadata.get("retired", {})  # a choice that was renamed: {old value: what to use now}
            if isinstance(data[name], str) and data[name] in retired:
                raise FieldError(prefix + name, f"= {show(data[name])} is no longer a choice. Fix: "
                                 f"{retired[data[name]]}.")
            kwargs[name] = _convert(data[name], hints[name], prefix + name)
        elif dataclasses.is_dataclass(hints[name]) and f.default_factory is dataclasses.MISSING:
            # A required section that is absent: building it from {} names its first missing field.
            kwargs[name] = build(hints[name], {}, prefix + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            doc = field_docs(typing.cast(type, cls)).get(name)
            under = f" under `{path}:`" if path else ""
            raise FieldError(
                prefix + name,
                f"is required but missing. Fix: add `{name}: ...`{under}"
                + (f" ({doc.rstrip('.')})" if doc else "")
                + ".",
            )
    try:
        return cls(**kwargs)
    except FieldError as err:
        raise err.under(path) from None


def flatten(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as a dict (dataclasses.asdict) to {"actor.optimizer.lr": 1e-06, ...}: one entry per leaf."""
    flat: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat


def _mark(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    return f" line {mark.line + 1} column {mark.column + 1}" if mark else ""


def _key_lines(node: yaml.Node, source: str, prefix: str, out: dict[str, str]) -> None:
    """Record where each dotted key was written; a key written twice is an error (YAML keeps the last)."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        line = f"{source} line {key_node.start_mark.line + 1}"
        if key in out:
            raise FieldError(
                key,
                f"is set twice ({out[key]} and again at line {key_node.start_mark.line + 1}). "
                "Fix: delete one of them; YAML would silently keep only the last.",
            )
        out[key] = line
        _key_lines(value_node, source, f"{key}.", out)


def read_yaml(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse a config file into (mapping, origins); origins maps dotted keys to `file line N`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(
            f"config file `{path}` does not exist (resolved to {path.resolve()}). "
            "Fix: pass the path of a YAML recipe, e.g. --config recipes/<name>.yaml."
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(
            f"config file `{path}` cannot be read ({err}). Fix: pass a readable UTF-8 YAML file."
        ) from None
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(
            f"config file `{path}` is not valid YAML at{_mark(err)}: {problem}. "
            "Fix the syntax there: indent with spaces, put a space after each `:`, and quote strings "
            "that contain `: ` or start with a special character."
        ) from None
    if not isinstance(data, dict):
        raise UserError(
            f"config file `{path}` must contain a mapping of sections (model:, actor:, ...) "
            f"but holds {show(data)}. Fix: start from one of the recipes in recipes/."
        )
    origins: dict[str, str] = {}
    if node is not None:
        _key_lines(node, str(path), "", origins)
    return data, origins


def apply_overrides(
    data: dict[str, Any], overrides: Sequence[str], origins: dict[str, str]
) -> dict[str, Any]:
    """Return a copy of `data` with each `dotted.key=value` applied; values are parsed as YAML."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not _KEY_RE.fullmatch(key):
            raise UserError(
                f"malformed override `--set {item}`: expected --set dotted.key=value. "
                "Fix: write it like --set actor.optimizer.lr=1e-6 (no spaces around `=`, quote the whole "
                "flag in the shell if the value has spaces)."
            )
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or err
            raise UserError(
                f"override `--set {item}`: the value `{raw}` is not valid YAML ({problem}). "
                "Fix: quote it, e.g. --set 'tracking.run_name=\"my run\"'."
            ) from None
        *parents, leaf = key.split(".")
        node = data
        for depth, part in enumerate(parents):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
                origins[".".join(parents[: depth + 1])] = f"--set {item}"
            elif not isinstance(child, dict):
                section = ".".join(parents[: depth + 1])
                raise FieldError(
                    section,
                    f"= {show(child)} is a value, not a section, so `--set {item}` cannot set a key in it. "
                    f"Fix: set `{section}` itself.",
                )
            node = child
        node[leaf] = value
        for stale in [k for k in origins if k.startswith(key + ".")]:
            del origins[stale]
        origins[key] = f"--set {item}"
    return data


def locate(err: FieldError, origins: Mapping[str, str]) -> FieldError:
    """Attach where the offending key (or its nearest enclosing section) was set."""
    parts = err.field.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        # an item of a list (agent.tools[0]) was set with its list (agent.tools), not with the section above it
        origin = origins.get(key) or origins.get(re.sub(r"(\[\d+\])+$", "", key))
        if origin:
            return FieldError(err.field, err.detail, origin)
    return err
