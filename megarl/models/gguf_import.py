"""GGUF -> HuggingFace directory (``python -m megarl.convert gguf-to-hf``).

transformers reads a GGUF file itself (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package),
dequantising every tensor, and rebuilds the tokenizer and its chat template from the file's metadata. Its
model is marked quantized and refuses ``save_pretrained``, and its config names no architecture, so this
module loads the weights that way, then writes an ordinary directory: safetensors in the chosen dtype, a
config.json in the hub's form (``architectures``, ``rope_theta`` beside transformers 5's ``rope_parameters``:
SGLang and vLLM read either), the tokenizer, and generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserError
from megarl.models.hf_io import atomic_dir

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""GGUF model types megarl trains, and their HF class (what transformers' GGUF loader builds for them)."""


def _load(gguf: Path) -> tuple[Any, Any]:
    try:
        import gguf as _  # noqa: F401
    except ImportError:
        raise UserError("--gguf needs the `gguf` package. Fix: pip install -r requirements.txt.") from None
    reader = check_whole(gguf)
    if reader is not None:
        check_rope_scaling(reader, gguf)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as err:  # an unsupported architecture, a damaged or foreign file
        raise UserError(f"--gguf {gguf}: transformers cannot read it ({' '.join(str(err).split())[:600]}). Fix: "
                        f"give a GGUF file of a {'/'.join(ARCHITECTURES)} model.") from None
    return model, tokenizer


def check_whole(path: Path) -> Any:
    """Refuse a GGUF file cut short, in its header (the reader's struct.error) or in its tensor data (which
    transformers reports without saying so), by the byte its last tensor ends at. Its GGUFReader, or None for a
    file that is no GGUF at all."""
    from gguf import GGUFReader

    size = path.stat().st_size
    fix = "Fix: download or convert the file again; a partial download is the usual cause."
    try:
        reader = GGUFReader(path)
    except Exception as err:  # its reads run past the end, or its values are garbage
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None  # not a GGUF at all: transformers names what it is not
        raise UserError(f"--gguf {path} cannot be read ({type(err).__name__}: {err}); the file ({size} bytes) is "
                        f"truncated or damaged. {fix}") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise UserError(f"--gguf {path} is truncated: its tensors end at byte {end}, the file has {size}. {fix}")
    return reader


def check_rope_scaling(reader: Any, path: Path) -> None:
    """Refuse a GGUF file whose RoPE is scaled: transformers' GGUF loader carries no scaling of a Llama/Qwen model
    into its config (llama.cpp stores Llama 3.1/3.2's `llama3` scaling as per-frequency factors in a
    `rope_freqs.weight` tensor, which it skips, and other kinds as `rope.scaling.*` keys, which it does not read),
    so the converted model would run unscaled RoPE and give other logits."""
    held = []
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        held.append("a `rope_freqs.weight` tensor (per-frequency RoPE factors: llama.cpp's form of Llama 3.1/3.2's "
                    "`llama3` rope scaling)")
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else ""
    keys = {k: reader.fields[k].contents() for k in reader.fields
            if k.startswith(f"{arch}.rope.scaling.") or k == f"{arch}.rope.scale_linear"}
    # llama.cpp never scales a model whose scaling type is "none", whatever other keys say, nor by a factor of 1
    factor = keys.get(f"{arch}.rope.scaling.factor", keys.get(f"{arch}.rope.scale_linear"))
    if keys and keys.get(f"{arch}.rope.scaling.type") != "none" and factor != 1.0:
        held.append(", ".join(f"{k} = {v!r}" for k, v in sorted(keys.items())))
    if held:
        raise UserError(f"--gguf {path} holds {' and '.join(held)}: its RoPE is scaled, and transformers' GGUF "
                        "reader drops that scaling, so the converted model would give other logits than the "
                        "original. Fix: convert from the original HuggingFace checkpoint instead (its config.json "
                        "carries rope_scaling, which megarl supports for `llama3`), e.g. hf-to-mcore on it or "
                        "model.hf_path pointing at it.")


def hub_config(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """transformers' config of a GGUF-loaded model, as the hub would hold it: the quantization and loader
    entries dropped, the architecture named, the RoPE base also where older readers look for it."""
    out = {k: v for k, v in config.items()
           if k not in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")}
    model_type = out.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UserError(f"the GGUF file holds a `{model_type}` model; megarl trains {', '.join(ARCHITECTURES)}. "
                        "Fix: convert a supported model.")
    out["architectures"] = [ARCHITECTURES[model_type]]
    out["dtype"] = dtype
    rope = out.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    return out


def gguf_to_hf(gguf: str | Path, out: str | Path, dtype: str = "bfloat16") -> None:
    """Write ``out`` (new) as a HF model directory holding the dequantised weights of ``gguf``."""
    import transformers

    path = Path(gguf)
    if not path.is_file():
        raise UserError(f"--gguf {path}: no such file. Fix: give the path of a .gguf file.")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}.")
    loaded, tokenizer = _load(path)
    config = hub_config(loaded.config.to_dict(), dtype)
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = getattr(transformers, config["architectures"][0])(hf_config)
    # The dequantised weights are plain float32 tensors: move them into an unquantised model of the same class.
    model.load_state_dict({k: v.to(DTYPES[dtype]) for k, v in loaded.state_dict().items()}, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    with atomic_dir(Path(out)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # save_pretrained writes transformers 5's form; keep the hub's keys next to it (see hub_config).
        written = json.loads((tmp / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps(written | {k: config[k] for k in ("architectures", "rope_theta")
                                                               if k in config}, indent=2) + "\n")
