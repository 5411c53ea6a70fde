"""A LoRA actor's checkpoint as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), which
peft's PeftModel.from_pretrained loads onto the base model (model.hf_path).

  python -m megarl.convert mcore-to-hf --ckpt DIR/step_N/actor --out DIR --peft

Megatron's fused layers become HF's separate ones with the same update: the shared A of the fused qkv (fc1) is each of
q/k/v_proj's (gate/up_proj's) lora_A, and B's rows split as the fused weight's do; o_proj's and down_proj's A split
over TP as their weights' columns do (megarl.lora.shards).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.checkpoint import manifest
from megarl.config.lora import TARGET_PATHS
from megarl.errors import UserError
from megarl.lora.saved import BASE_MODEL, LORA_DIR, SavedAdapters, adapter_files
from megarl.lora.shards import factor_to_hf
from megarl.models.hf_io import atomic_dir
from megarl.models.mapping import param_rules
from megarl.models.spec import ModelSpec, load_spec

ADAPTER_FILE = "adapter_model.safetensors"
EXPORT = "megarl_export.json"
"""Beside a --peft export: the adapter file's size and CRC-32 and the base model's record (lora/base_model.json),
so that megarl.evaluate refuses a damaged adapter, or one merged onto another base."""
REEXPORT = "python -m megarl.convert mcore-to-hf --ckpt RUN/step_N/actor --out DIR --peft"


def export_peft(ckpt: str | Path, out: str | Path, base_model: str | None = None) -> None:
    """Write the adapters of the LoRA actor checkpoint ``ckpt`` (.../step_N/actor) to ``out`` in PEFT's format, for
    ``base_model`` (default: the base they were trained on, as the checkpoint records it)."""
    ckpt, out = Path(ckpt), Path(out)
    files = adapter_files(ckpt)
    if not files:
        raise UserError(f"{ckpt} holds no LoRA adapters ({LORA_DIR}/rank*.safetensors): it is not the actor of a run "
                        "with actor.lora. Export it without --peft (the full weights).")
    saved = SavedAdapters(files)
    recorded = ckpt / LORA_DIR / BASE_MODEL
    record = json.loads(recorded.read_text()) if recorded.is_file() else None
    if base_model is None and record is not None:
        base_model = record.get("path")
    # as the other exports: refused over a non-empty --out, and never left half-written there
    with atomic_dir(out) as tmp:
        write_peft(tmp, load_spec(ckpt), saved.lora, saved.factor, base_model)
        adapter = manifest.describe(tmp, [tmp / ADAPTER_FILE], sync=False)
        (tmp / EXPORT).write_text(json.dumps({"adapter": adapter, "base_model": record}, indent=1) + "\n")


def check_export(adapter: Path, base: str) -> None:
    """Refuse the PEFT adapter directory ``adapter`` (``--model``) when its adapter file is not whole, or, for a
    megarl export, when its file or the base model at ``base`` differ from what the export recorded."""
    flag = f"--model {adapter}"
    if (adapter / EXPORT).is_file():
        try:
            record = json.loads((adapter / EXPORT).read_text())
            files, trained_on = dict(record["adapter"]), record["base_model"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"{flag}: {EXPORT} is unreadable ({type(err).__name__}: {err}). Fix: export the adapter "
                            f"again ({REEXPORT}).") from None
        bad = manifest.problems(adapter, files, files)
        if bad:
            raise UserError(f"{flag} is damaged: {bad[0]}. Fix: export the adapter again ({REEXPORT}).")
        differ = manifest.files_differ(trained_on["files"], base) if trained_on and trained_on.get("files") else []
        if differ:
            raise UserError(f"{flag} was trained on the base model at {trained_on.get('path')}, whose weight files "
                            f"differ from {base} (adapter_config.json's base_model_name_or_path) ({differ[:3]}: size "
                            "or CRC-32); adapters merged onto another base give another policy. Fix: point "
                            "base_model_name_or_path at the base they were trained on.")
    if (adapter / ADAPTER_FILE).is_file():
        try:
            with safe_open(str(adapter / ADAPTER_FILE), "pt"):
                pass  # opening checks the header and that every tensor's bytes are there
        except Exception as err:
            raise UserError(f"{flag}: {ADAPTER_FILE} is not a whole safetensors file ({type(err).__name__}: {err}); "
                            "it is truncated or damaged. Fix: export or download the adapter again.") from None


def write_peft(out: Path, spec: ModelSpec, lora: dict[str, Any], factor: Callable[[str], list[torch.Tensor]],
               base_model: str | None = None) -> None:
    """Adapters in PEFT's format in ``out`` of a LoRA config ``lora`` (LoraConfig's fields): ``factor(name)`` is a
    canonical factor's shards, by TP rank."""
    rank: int = lora["rank"]
    rules = {r.mcore: r for r in param_rules(spec, include_output=False)}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for target in lora["target_modules"]:
            module = f"decoder.layers.{layer}.{'.'.join(TARGET_PATHS[target])}"
            rule = rules[f"{module}.weight"]
            a_parts, b_parts = factor(f"{module}.lora.A"), factor(f"{module}.lora.B")
            column = target in ("qkv", "fc1")
            hf_split = factor_to_hf(spec, rule, b_parts if column else a_parts, rank)
            for hf in rule.hf:
                prefix = "base_model.model." + hf.removesuffix(".weight")
                # copies: q/k/v_proj (gate/up_proj) share Megatron's one A, and a file holds each tensor once
                tensors[f"{prefix}.lora_A.weight"] = (a_parts[0] if column else hf_split[hf]).clone()
                tensors[f"{prefix}.lora_B.weight"] = (hf_split[hf] if column else b_parts[0]).clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    names = sorted({hf.split(".")[-2] for target in lora["target_modules"]
                    for hf in rules[f"decoder.layers.0.{'.'.join(TARGET_PATHS[target])}.weight"].hf})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": lora["alpha"],
              "lora_dropout": lora["dropout"], "use_rslora": lora["rslora"], "bias": "none",
              "target_modules": names, "base_model_name_or_path": base_model or "", "fan_in_fan_out": False,
              "init_lora_weights": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")

