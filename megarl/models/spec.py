"""The architecture of a HuggingFace Llama/Qwen2/Qwen3 checkpoint, read from its config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.errors import UserError

# HF architecture name -> family. Qwen2 differs from Llama only by QKV bias (and often tied embeddings);
# Qwen3 (dense) by a per-head RMSNorm on queries and keys before RoPE (QK-norm), without the bias.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes and hyper-parameters of a decoder-only model; everything that layouts depend on."""

    family: str
    """"llama", "qwen2" or "qwen3"."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """HF rope_scaling of type "llama3" (Llama 3.1+), or None."""
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    qk_norm: bool
    """RMSNorm over head_dim on every query and key head (weights of head_dim, shared by all heads)."""
    hf_config: dict[str, Any]
    """The config.json as read, written back unchanged on export."""

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int, multiple: int) -> int:
        """Megatron's vocab rows: the vocab rounded up to ``multiple * tp`` so every TP shard is equal."""
        step = multiple * tp
        return math.ceil(self.vocab_size / step) * step

    def layer_params(self) -> int:
        """Parameters of one transformer layer, its two norms (2 * hidden_size) included."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + (q + 2 * kv if self.qkv_bias else 0)
                + (2 * self.head_dim if self.qk_norm else 0))

    def num_params(self) -> int:
        """Parameter count of the HF model (embedding counted once when tied)."""
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params() + embed + h


def _require(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg:
        raise UserError(f"{path} has no `{key}`; a Llama/Qwen2/Qwen3 config.json must define it. "
                        "Re-download the model or fix the file.")
    return cfg[key]


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files use rope_theta/rope_scaling.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise UserError(f"{path}: rope scaling type `{kind}` is not supported (megarl supports none or "
                            "`llama3`). Use a model without this rope scaling.")
        else:
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                _require(scaling, key, path)
    return theta, scaling


def load_spec(hf_dir: str | Path) -> ModelSpec:
    """Read ``hf_dir/config.json``; a missing, corrupt or unsupported config is a UserError."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise UserError(f"model directory `{hf_dir}` does not exist. Pass a HuggingFace model directory "
                        "holding config.json and *.safetensors.")
    if not path.is_file():
        raise UserError(f"`{hf_dir}` has no config.json. Pass a HuggingFace model directory "
                        "(config.json, *.safetensors, tokenizer files).")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}). Re-download the model.") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path} must hold a JSON object. Re-download the model.")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UserError(f"{path}: architecture {archs or cfg.get('model_type')} is not supported; megarl "
                        f"supports {sorted(SUPPORTED_ARCHITECTURES)}.")
    family = SUPPORTED_ARCHITECTURES[arch]
    num_heads = int(_require(cfg, "num_attention_heads", path))
    hidden = int(_require(cfg, "hidden_size", path))
    num_kv = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv:
        raise UserError(f"{path}: num_attention_heads={num_heads} is not a multiple of "
                        f"num_key_value_heads={num_kv}. Fix the config.")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"{path}: hidden_act={cfg['hidden_act']!r} is not supported (Llama/Qwen2/Qwen3 use silu).")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UserError(f"{path}: attention_bias/mlp_bias are not supported by megarl's Llama mapping.")
    theta, scaling = _rope(cfg, path)
    return ModelSpec(
        family=family,
        vocab_size=int(_require(cfg, "vocab_size", path)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", path)),
        num_layers=int(_require(cfg, "num_hidden_layers", path)),
        num_attention_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        qk_norm=family == "qwen3",
        hf_config=cfg,
    )
