"""Checkpoint conversion between HuggingFace and megarl's Megatron layout.

  python -m megarl.convert hf-to-mcore --hf DIR --out DIR --tp N --pp M
  python -m megarl.convert mcore-to-hf --ckpt DIR --out DIR [--merge | --peft]
  python -m megarl.convert gguf-to-hf --gguf FILE --out DIR [--dtype bfloat16|float32]

The round trip is bit-exact: dtypes are kept and vocab padding is dropped on export. gguf-to-hf dequantises
a GGUF file (e.g. SmolLM2-135M-Instruct, scripts/get_smollm2.sh) into an ordinary HF directory. A LoRA actor's
checkpoint exports as the merged model, or with --peft as its adapters alone (megarl.lora.export).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from megarl.checkpoint.part_check import check_part
from megarl.errors import UserError
from megarl.models.hf_io import write_hf
from megarl.models.mcore_ckpt import hf_to_mcore, open_mcore
from megarl.run.command import run_main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megarl.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron TP/PP shards")
    to_mcore.add_argument("--hf", required=True, help="HF model directory (config.json, *.safetensors)")
    to_mcore.add_argument("--out", required=True, help="new checkpoint directory")
    to_mcore.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    to_mcore.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    to_mcore.add_argument("--vocab-pad-multiple", type=positive_int, default=128,
                          help="pad the vocab to a multiple of this times TP (as training does)")
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron TP/PP shards -> HF safetensors + config.json")
    to_hf.add_argument("--ckpt", required=True, help="megarl Megatron checkpoint directory")
    to_hf.add_argument("--out", required=True, help="new HF model directory")
    form = to_hf.add_mutually_exclusive_group()
    form.add_argument("--merge", action="store_true",
                      help="the full model; a LoRA actor's (actor.lora) with its adapters merged, W + s B A (default)")
    form.add_argument("--peft", action="store_true",
                      help="a LoRA actor's checkpoint: its adapters alone, as a PEFT adapter directory for the base")
    from_gguf = sub.add_parser("gguf-to-hf", help="GGUF file -> HF safetensors, config.json, tokenizer")
    from_gguf.add_argument("--gguf", required=True, help="a .gguf file (any quantisation transformers reads)")
    from_gguf.add_argument("--out", required=True, help="new HF model directory")
    from_gguf.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                           help="dtype of the written weights")
    # argparse's own errors already exit with code 2 and a one-line message.
    return parser.parse_args(argv)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (0 used to fail deep inside the conversion)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} is an existing file, not a directory. Fix: name a new directory for the "
                        "converted model (or move that file away).")
    start = time.perf_counter()
    if args.command == "hf-to-mcore":
        hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.vocab_pad_multiple, log=True)
    elif args.command == "gguf-to-hf":
        from megarl.models.gguf_import import gguf_to_hf

        gguf_to_hf(args.gguf, args.out, args.dtype)
    elif args.peft:
        from megarl.lora.export import export_peft

        check_part(Path(args.ckpt), "--ckpt")
        export_peft(args.ckpt, args.out)
    else:
        check_part(Path(args.ckpt), "--ckpt")
        spec, tensors = open_mcore(args.ckpt)
        write_hf(args.out, tensors, spec, source_dir=args.ckpt)
    print(f"{args.command}: wrote {args.out} in {time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    run_main(main)
