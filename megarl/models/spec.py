"""The architecture of a HuggingFace Llama/Qwen2/Qwen3 checkpoint, read from its config.json."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.errors import UserError

# HF architecture name -> family. Qwen2 differs from Llama only by QKV bias (and often tied embeddings);
# Qwen3 (dense) by a per-head RMSNorm on queries and keys before RoPE (QK-norm), without the bias; Qwen3-MoE
# by a mixture of experts in place of every layer's MLP (a softmax router, top-k experts, no shared expert).
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                           "Qwen3MoeForCausalLM": "qwen3_moe"}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes and hyper-parameters of a decoder-only model; everything that layouts depend on."""

    family: str
    """"llama", "qwen2", "qwen3" or "qwen3_moe"."""
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
    num_experts: int = 0
    """Experts per MoE layer (every layer); 0 = a dense MLP."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's MLP width."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing probabilities to sum to 1 (softmax over all experts, then top-k)."""

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def ffn_size(self, expert: bool) -> int:
        """Width of a dense MLP, or of one expert's."""
        return self.moe_intermediate_size if expert else self.intermediate_size

    def padded_vocab_size(self, tp: int, multiple: int) -> int:
        """Megatron's vocab rows: the vocab rounded up to ``multiple * tp`` so every TP shard is equal."""
        step = multiple * tp
        return math.ceil(self.vocab_size / step) * step

    def attention_params(self) -> int:
        """Parameters of one layer's attention, QK-norm and QKV bias included."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm
                                                                                   else 0)

    def expert_params(self) -> int:
        """Parameters of one layer's experts (0 for a dense model)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def layer_params(self) -> int:
        """Parameters of one transformer layer, its two norms (2 * hidden_size) and an MoE router included."""
        h = self.hidden_size
        mlp = self.expert_params() + self.num_experts * h if self.is_moe else 3 * h * self.intermediate_size
        return self.attention_params() + mlp + 2 * h

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


def _bad(path: Path, key: str, value: Any, should: str) -> UserError:
    return UserError(f"{path}: `{key}` is {json.dumps(value)}, but it must be {should}; correct that field of "
                     "config.json or download the model again.")


def _positive_int(cfg: dict[str, Any], key: str, path: Path, default: int | None = None) -> int:
    """``cfg[key]``, required unless ``default`` is given (then also taken for null, as transformers does)."""
    value = _require(cfg, key, path) if default is None else cfg.get(key)
    if value is None and default is not None:
        return default
    # bool is an int in Python; a JSON true is damage, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(path, key, value, "a positive integer")
    return value


def _positive_float(cfg: dict[str, Any], key: str, path: Path, default: float | None, within: str = "") -> float:
    """``cfg[key]`` (required where ``default`` is None) of the object ``within`` names ("" for the top level)."""
    value = cfg.get(key, default) if default is not None else _require(cfg, key, path)
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
        raise _bad(path, f"{within}{key}", value, "a positive finite number")
    return float(value)


def _flag(cfg: dict[str, Any], key: str, path: Path) -> bool:
    value = cfg.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(path, key, value, "true or false")
    return value


def _object(cfg: dict[str, Any], key: str, path: Path) -> dict[str, Any] | None:
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise _bad(path, key, value, "a JSON object (or null)")
    return value or None


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files use rope_theta/rope_scaling.
    params = _object(cfg, "rope_parameters", path) or {}
    scaling, within = _object(cfg, "rope_scaling", path), "rope_scaling."
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling, within = params, "rope_parameters."
    theta = (_positive_float(cfg, "rope_theta", path, 10000.0) if "rope_theta" in cfg
             else _positive_float(params, "rope_theta", path, 10000.0, "rope_parameters."))
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise UserError(f"{path}: rope scaling type `{kind}` is not supported (megarl supports none or "
                            "`llama3`). Use a model without this rope scaling.")
        else:
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                _positive_float(scaling, key, path, None, within)
            if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:  # the smoothing between them divides
                raise _bad(path, f"{within}high_freq_factor", scaling["high_freq_factor"],
                           f"above {within}low_freq_factor ({scaling['low_freq_factor']})")
    return theta, scaling


def _refuse_sliding_window(cfg: dict[str, Any], path: Path) -> None:
    """Megatron's layers attend to every earlier token: a model whose layers transformers (and the engines) run
    with a sliding window would score and train differently from how it generates."""
    layer_types = cfg.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise _bad(path, "layer_types", layer_types, 'a list of one attention type per layer ("full_attention")')
    sliding = [t for t in layer_types if t != "full_attention"]
    if cfg.get("use_sliding_window") or sliding:
        found = (f"use_sliding_window={cfg.get('use_sliding_window')!r} (sliding_window="
                 f"{cfg.get('sliding_window')!r}, max_window_layers={cfg.get('max_window_layers')!r})"
                 if cfg.get("use_sliding_window") else f"layer_types holds {sorted(set(sliding))}")
        raise UserError(f"{path}: {found}: sliding-window attention is not supported; megarl's Megatron layers "
                        "attend to every earlier token. Fix: use a model with full attention in every layer "
                        "(use_sliding_window false, as Qwen2.5's and Qwen3's released models have); if the window "
                        "is at least as long as every sequence you train and generate, the two are the same, and a "
                        "copy of the model with use_sliding_window false and layer_types all \"full_attention\" "
                        "is that model.")


def load_spec(hf_dir: str | Path, field: str | None = None) -> ModelSpec:
    """Read ``hf_dir/config.json``; a missing, corrupt or unsupported config is a UserError (naming ``field``, the
    config key that gave the directory, where there is one)."""
    path = Path(hf_dir) / "config.json"
    try:
        with damaged_values(path):
            return spec_from_config(read_config(hf_dir), path)
    except UserError as err:
        if field is None:
            raise
        raise UserError(f"{field} = {str(hf_dir)!r}: {err}") from None


@contextmanager
def damaged_values(path: Path) -> Iterator[None]:
    """A damaged value of config.json that the checks do not foresee is still the file's fault: a UserError."""
    try:
        yield
    except UserError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, ZeroDivisionError) as err:
        raise UserError(f"{path} holds a value megarl cannot read ({type(err).__name__}: {err}). Correct "
                        "config.json or download the model again.") from None


def read_config(hf_dir: str | Path) -> dict[str, Any]:
    """``hf_dir/config.json`` as a dict; a missing directory or file, or one that is not a JSON object, is a
    UserError."""
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
    return cfg


def architectures(cfg: dict[str, Any], path: Path, supported: dict[str, str]) -> list[str]:
    """config.json's `architectures`: a list of class names, as transformers writes it."""
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs):
        return archs
    model_type = str(cfg.get("model_type")).replace("_", "").lower()
    example = next((a for a in sorted(supported) if a.lower().startswith(model_type)), sorted(supported)[0])
    found = "missing" if archs is None else f"{json.dumps(archs)}, not a list of class names"
    raise UserError(f"{path}: `architectures` is {found}. Write the model's class there as a list, e.g. "
                    f"\"architectures\": [\"{example}\"] (megarl supports {sorted(supported)}), or download the "
                    "model again.")


def spec_from_config(cfg: dict[str, Any], path: Path) -> ModelSpec:
    """The spec of a config.json read from ``path`` (named in errors)."""
    archs = architectures(cfg, path, SUPPORTED_ARCHITECTURES)
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UserError(f"{path}: architecture {archs} is not supported; megarl supports "
                        f"{sorted(SUPPORTED_ARCHITECTURES)}.")
    family = SUPPORTED_ARCHITECTURES[arch]
    num_heads = _positive_int(cfg, "num_attention_heads", path)
    hidden = _positive_int(cfg, "hidden_size", path)
    num_kv = _positive_int(cfg, "num_key_value_heads", path, num_heads)
    head_dim = _positive_int(cfg, "head_dim", path, hidden // num_heads)
    if num_heads % num_kv:
        raise UserError(f"{path}: num_attention_heads={num_heads} is not a multiple of "
                        f"num_key_value_heads={num_kv}. Fix the config.")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"{path}: hidden_act={cfg['hidden_act']!r} is not supported (Llama/Qwen2/Qwen3 use silu).")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UserError(f"{path}: attention_bias/mlp_bias are not supported by megarl's Llama mapping.")
    _refuse_sliding_window(cfg, path)
    theta, scaling = _rope(cfg, path)
    moe: dict[str, Any] = {}
    if family == "qwen3_moe":
        moe = _moe(cfg, path)
    return ModelSpec(
        family=family,
        vocab_size=_positive_int(cfg, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size", path),
        num_layers=_positive_int(cfg, "num_hidden_layers", path),
        num_attention_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", path, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", path),
        qkv_bias=family == "qwen2",
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings", path, 4096),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        hf_config=cfg,
        **moe,
    )


def _moe(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config.json (transformers >= 5 writes num_local_experts for num_experts)."""
    num_experts = _positive_int(cfg, "num_experts" if cfg.get("num_experts") else "num_local_experts", path)
    top_k = _positive_int(cfg, "num_experts_per_tok", path)
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise UserError(f"{path}: decoder_sparse_step={cfg.get('decoder_sparse_step')} and mlp_only_layers="
                        f"{cfg.get('mlp_only_layers')}: megarl's Qwen3-MoE mapping needs experts in every layer "
                        "(decoder_sparse_step 1, no mlp_only_layers), as Qwen3's released MoE models have.")
    if not 1 <= top_k <= num_experts:
        raise UserError(f"{path}: num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}.")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": _positive_int(cfg, "moe_intermediate_size", path),
            # transformers' Qwen3MoeConfig default: a config.json without the key routes without renormalising.
            "norm_topk_prob": _flag(cfg, "norm_topk_prob", path)}
