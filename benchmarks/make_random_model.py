"""Write a HF checkpoint of a real model's shape with random weights (no hub needed), for runs at scale.

  python benchmarks/make_random_model.py --preset llama3-8b --tokenizer recipes/tiny/model --out /tmp/llama8b
      [--layers N] [--config-only]

The body (hidden size, layers, heads, MLP) is the preset's; the vocabulary and the tokenizer files are
those of --tokenizer, so that recipes with that tokenizer run on it and every generated token decodes.
Weights are N(0, 0.02) (norms 1) in bfloat16, generated on the GPU when there is one, one shard per layer.
--config-only writes config.json and the tokenizer alone, for engines that make up their own weights
(SGLang's and vLLM's load_format=dummy).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from megarl.models.mapping import hf_shapes
from megarl.models.presets import PRESETS
from megarl.models.spec import load_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--tokenizer", required=True, help="HF directory whose tokenizer and vocab size are used")
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=None, help="keep only this many layers")
    parser.add_argument("--config-only", action="store_true", help="no weights (for load_format=dummy)")
    args = parser.parse_args()
    out, tok = Path(args.out), Path(args.tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    source = json.loads((tok / "config.json").read_text())
    cfg = dict(PRESETS[args.preset]) | {"vocab_size": source["vocab_size"], "torch_dtype": "bfloat16",
                                        "max_position_embeddings": 8192, "tie_word_embeddings": False}
    cfg |= {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in source}
    cfg.pop("rope_scaling", None)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)

    def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    copy_tokenizer(tok, out)
    if args.config_only:
        print(f"wrote {out}: {args.preset} body config, vocab {cfg['vocab_size']}, no weights", flush=True)
        return
    shards: list[dict[str, tuple[int, ...]]] = [{} for _ in range(cfg["num_hidden_layers"] + 1)]
    for name, shape in hf_shapes(load_spec(out)).items():  # one shard per layer, the rest in the first
        shards[int(name.split(".")[2]) + 1 if name.startswith("model.layers.") else 0][name] = shape
    index: dict[str, str] = {}
    total = 0
    for n, shapes in enumerate(shards):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: tensor(k, s) for k, s in shapes.items()}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index |= {k: name for k in tensors}
        total += sum(t.numel() * 2 for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}))
    print(f"wrote {out}: {args.preset} body, vocab {cfg['vocab_size']}, {total / 2**30:.1f} GiB bf16", flush=True)


def copy_tokenizer(tok: Path, out: Path) -> None:
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, out / f.name)


if __name__ == "__main__":
    main()
