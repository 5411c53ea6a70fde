"""The HF format of a reward model: a `*ForSequenceClassification` with one label, whose head `score.weight`
[1, hidden] reads the body's last hidden state. Light (no megatron): the converter and start-up checks use it."""

from __future__ import annotations

from typing import Any

from megarl.errors import UserError

SEQUENCE_CLASSIFICATION = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                           "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                           "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
"""The reward models megarl loads, and the causal LM of the same body (whose Megatron mapping they share)."""
HEAD = "score.weight"


def num_labels(cfg: dict[str, Any]) -> int:
    """transformers' num_labels of a config.json: its own key where written, else the size of id2label (what
    save_pretrained writes), else transformers' default, 2."""
    if "num_labels" in cfg:
        return int(cfg["num_labels"])
    return len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else 2


def reward_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """A causal LM's config.json made that of its `*ForSequenceClassification` with one label: what a reward model
    or critic trained here exports as (``where`` names the checkpoint in the error for another architecture)."""
    causal = {v: k for k, v in SEQUENCE_CLASSIFICATION.items()}
    arch = next((a for a in cfg.get("architectures") or [] if a in causal), None)
    if arch is None:
        raise UserError(f"{where}: architecture {cfg.get('architectures')} has no sequence-classification form "
                        f"megarl writes; it writes {sorted(SEQUENCE_CLASSIFICATION)}.")
    return cfg | {"architectures": [causal[arch]], "num_labels": 1, "id2label": {"0": "LABEL_0"},
                  "label2id": {"LABEL_0": 0}}
