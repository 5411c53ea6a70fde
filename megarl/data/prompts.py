"""Prompt datasets: records with a prompt and a reference answer, from jsonl, parquet or vendored GSM8K."""

from __future__ import annotations

import dataclasses
import json
import math
import string
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from megarl.errors import UserError

# GSM8K (Cobbe et al. 2021, MIT licence, see gsm8k/LICENSE): 7473 train and 1319 test problems.
_VENDORED = {"gsm8k": "train", "gsm8k:train": "train", "gsm8k:test": "test"}
_GSM8K_DIR = Path(__file__).resolve().parent / "gsm8k"


@dataclass(frozen=True, slots=True)
class PromptRecord:
    prompt: str
    answer: str
    """Reference answer, passed to the reward function as is."""
    source: str = dataclasses.field(default="", compare=False)
    """Where the record came from ("FILE line N" or "FILE row N"), for errors found after reading."""


def template_fields(template: str, field: str) -> list[str]:
    """The record fields a prompt template names; a template Python cannot format, or with positional fields,
    is a UserError naming ``field``."""
    def named(text: str) -> list[str]:  # a format spec may name fields too: "{question:{width}}"
        return [n for _, name, spec, _ in string.Formatter().parse(text) if name is not None
                for n in [name, *named(spec or "")]]

    try:
        names = named(template)
    except ValueError as err:
        raise UserError(f"{field} = {template!r} is not a format string ({err}). Fix: name record fields in "
                        "braces, e.g. \"{question}\", and write literal braces as {{ and }}.") from None
    bad = [name for name in names if not name.isidentifier()]
    if bad:
        raise UserError(f"{field} = {template!r} has the field {{{bad[0]}}}, which is not a record key. Fix: name "
                        "record fields in braces, e.g. \"{question}\", and write literal braces as {{ and }}.")
    return names


def load_prompts(path_or_name: str, prompt_key: str = "question", answer_key: str = "answer",
                 template: str | None = None, field: str = "data.train_path") -> list[PromptRecord]:
    """Read `data.train_path`: "gsm8k" (= "gsm8k:train") or "gsm8k:test", or a .jsonl / .parquet file.

    Each record must hold a string prompt under `prompt_key` (or, with ``template``, the fields the template
    names, data.prompt_template) and an answer (string or number) under `answer_key`. Bad input raises
    UserError naming ``field``, the file, the line or row, and the fix.
    """
    if path_or_name in _VENDORED:
        path = _GSM8K_DIR / f"{_VENDORED[path_or_name]}.jsonl"
        if not path.is_file():
            raise UserError(
                f"{field} = {path_or_name!r}, but {path} is missing: this megarl was installed without "
                "its package data. Fix: reinstall megarl from a full source checkout."
            )
    elif path_or_name.startswith("gsm8k:"):
        raise UserError(
            f"{field} = {path_or_name!r} is not a vendored dataset. Fix: use one of {sorted(_VENDORED)}."
        )
    else:
        path = Path(path_or_name)
    if not path.is_file():
        raise UserError(
            f"{field} = {path_or_name!r}: no such file. Fix: give an existing .jsonl or .parquet file, "
            f"or one of {sorted(_VENDORED)}."
        )
    if path.suffix == ".jsonl":
        rows = read_jsonl(path, field)
    elif path.suffix == ".parquet":
        rows = read_parquet(path, field)
    else:
        raise UserError(
            f"{field} = {path_or_name!r} has suffix {path.suffix!r}. Fix: convert it to .jsonl "
            "(one JSON object per line) or .parquet."
        )
    keys = _key_fields(field)
    if template is not None and answer_key in template_fields(template, keys["prompt_template"]):
        raise UserError(f"{keys['prompt_template']} = {template!r} names {{{answer_key}}}, the reference answer "
                        f"({keys['answer_key']}): every prompt would hold the answer its reward checks. Fix: leave "
                        f"{{{answer_key}}} out of the template.")
    records = [_record(row, where, prompt_key, answer_key, template, field) for where, row in rows]
    if not records:
        raise UserError(f"{field} = {path_or_name!r} holds no records. Fix: point it at a non-empty file.")
    return records


def read_jsonl(path: Path, field: str) -> list[tuple[str, Any]]:
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(
                    f"{field} {path} line {number} is not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1}). Fix: re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`."
                ) from None
            if not line.strip():
                continue
            try:
                rows.append((f"{path} line {number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise UserError(
                    f"{field} {path} line {number} is not valid JSON ({err.msg} at column {err.colno}). "
                    "Fix: write one JSON object per line."
                ) from None
    return rows


def read_parquet(path: Path, field: str) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"{field} {path} is parquet, which needs pyarrow. "
            "Fix: pip install pyarrow, or convert it to .jsonl."
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several unrelated types for a damaged file
        raise UserError(
            f"{field} {path} is not a readable parquet file ({err}). Fix: rewrite the file."
        ) from None
    return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist(), start=1)]


def _record(row: Any, where: str, prompt_key: str, answer_key: str, template: str | None = None,
            field: str = "data.train_path") -> PromptRecord:
    keys = _key_fields(field)
    if not isinstance(row, dict):
        raise UserError(
            f"{field} {where} is a JSON {type(row).__name__}, not an object. "
            f'Fix: write records like {{"{prompt_key}": "...", "{answer_key}": "..."}}.'
        )
    if template is not None:
        missing = [name for name in template_fields(template, keys["prompt_template"]) if name not in row]
        if missing:
            raise UserError(f"{field} {where} has no key {missing[0]!r}, which {keys['prompt_template']} names; "
                            f"its keys are {sorted(row)}. Fix: name those keys in the template.")
        try:
            row = row | {prompt_key: template.format_map(row)}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:  # a format spec or conversion
            raise UserError(f"{keys['prompt_template']} = {template!r} cannot format {field} {where} "
                            f"({type(err).__name__}: {err}). Fix: name the record's fields plainly, as in "
                            '"{question}", without a format spec (":d") or conversion ("!x").') from None
    for key_field, key in ((keys["prompt_key"], prompt_key), (keys["answer_key"], answer_key)):
        if key not in row:
            raise UserError(
                f"{field} {where} has no key {key!r} ({key_field}); its keys are {sorted(row)}. "
                f"Fix: set {key_field} to the key that holds it."
            )
    prompt, answer = row[prompt_key], row[answer_key]
    if not isinstance(prompt, str):
        raise UserError(
            f"{field} {where}: {prompt_key!r} ({keys['prompt_key']}) is a {type(prompt).__name__}, not a string. "
            "Fix: store the prompt text under that key."
        )
    if not prompt.strip():
        raise UserError(
            f"{field} {where}: {prompt_key!r} ({keys['prompt_key']}) is empty; the engine cannot generate from "
            "an empty prompt. Fix: remove the record or give it a prompt."
        )
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise UserError(
            f"{field} {where}: {answer_key!r} ({keys['answer_key']}) is a {type(answer).__name__}, not a string "
            "or number. Fix: store the reference answer as text."
        )
    if isinstance(answer, float) and not math.isfinite(answer):
        raise UserError(
            f"{field} {where}: {answer_key!r} ({keys['answer_key']}) is {answer}, not a number a response can "
            "equal. Fix: give the record its reference answer, or remove it."
        )
    # A float as written positionally: str() gives "1e+16" and "5e-05", which answer extraction reads as 1 and 5.
    text = format(Decimal(repr(answer)), "f") if isinstance(answer, float) else str(answer)
    return PromptRecord(prompt=prompt, answer=text, source=where)


def _key_fields(field: str) -> dict[str, str]:
    """The settings that name the keys of the records ``field`` points at: data.train_path's are data.*, an
    eval set's (eval.datasets[i].path) its own, the --data flag's the flags --prompt-key etc."""
    if field.startswith("--"):
        return {"prompt_key": "--prompt-key", "answer_key": "--answer-key", "prompt_template": "--prompt-template"}
    section = field.rsplit(".", 1)[0]
    return {key: f"{section}.{key}" for key in ("prompt_key", "answer_key", "prompt_template")}
