"""HF config.json contents of well-known model shapes, for benchmarks and plans without a checkpoint."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from megarl.errors import UserError
from megarl.models.spec import ModelSpec, load_spec

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1000, hidden_size=256,
                 intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 rms_norm_eps=1e-5,
                 rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False),
    "llama-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=2048,
                     intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                     rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                      max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen2-7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
                     tie_word_embeddings=False),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False),
    "qwen3-4b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2560,
                     intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=True),
    "llama3-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
                       intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                       max_position_embeddings=131072, tie_word_embeddings=False),
}


def preset_or_hf_spec(name_or_dir: str, num_layers: int | None = None) -> ModelSpec:
    """A preset's spec, or the spec of a HF directory; ``num_layers`` keeps only the first layers."""
    if name_or_dir in PRESETS:
        config = dict(PRESETS[name_or_dir])
    elif Path(name_or_dir).is_dir():
        config = json.loads((Path(name_or_dir) / "config.json").read_text()) if (
            Path(name_or_dir) / "config.json").is_file() else {}
        if num_layers is None:
            return load_spec(name_or_dir)
    else:
        raise UserError(f"--model `{name_or_dir}` is neither a preset ({', '.join(PRESETS)}) nor a HF model "
                        "directory.")
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return load_spec(tmp)
