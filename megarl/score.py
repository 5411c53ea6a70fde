"""Per-token log-probabilities of given token sequences under a HF model, in any TP/PP/DP layout.

  torchrun --nproc-per-node W -m megarl.score --hf DIR --tp N --pp M [--ep E] --input IN.jsonl --output OUT.jsonl

Each input line is {"tokens": [int, ...]} (at least two tokens); each output line, in the same
order, is {"logprobs": [...]} with log p(token_t | tokens before t) for t = 1..len-1.
Sequences are spread over the W / (N * M) data-parallel replicas; an MoE model's experts may be split over
E of them (expert parallelism, E dividing the replicas and the expert count).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from megarl.errors import UserError
from megarl.run.command import run_main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun -m megarl.score", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", required=True, help="HF model directory (config.json, *.safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1,
                        help="MoE: expert-parallel size (the experts split over this many data-parallel replicas)")
    parser.add_argument("--input", required=True, help='jsonl, one {"tokens": [...]} per line')
    parser.add_argument("--output", required=True, help='jsonl written with one {"logprobs": [...]} per line')
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="score under softmax(logits / T), the distribution an engine samples from at T (> 0)")
    parser.add_argument("--logprob-chunk-tokens", type=int, default=1024,
                        help="log-probabilities from the output layer's input this many tokens at a time, never the "
                             "whole logits (model.logprob_chunk_tokens); 0 = from the full logits")
    args = parser.parse_args(argv)
    if args.logprob_chunk_tokens < 0:
        raise UserError(f"--logprob-chunk-tokens {args.logprob_chunk_tokens}: must be >= 0. Pass 1024, or 0 for "
                        "the full logits.")
    if args.micro_batch_size < 1:
        raise UserError(f"--micro-batch-size {args.micro_batch_size}: must be >= 1 (sequences per forward pass). "
                        "Pass 4, or 1 where memory is short.")
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise UserError(f"--temperature {args.temperature}: must be a finite number > 0 (greedy decoding, T = 0, "
                        "has no log-probabilities). Pass the sampling temperature, e.g. --temperature 1.0.")
    return args


def read_sequences(path: str, vocab_size: int) -> list[list[int]]:
    if not Path(path).is_file():
        raise UserError(f"--input `{path}` does not exist. Pass a jsonl file of {{\"tokens\": [...]}} lines.")
    sequences = []
    with open(path) as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tokens = json.loads(line)["tokens"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"--input {path} line {num} is not a JSON object with a `tokens` list.") from None
            if (not isinstance(tokens, list) or len(tokens) < 2
                    or not all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens)):
                raise UserError(f"--input {path} line {num}: `tokens` must be a list of at least two ints in "
                                f"[0, {vocab_size}) (the model's vocab_size).")
            sequences.append(tokens)
    if not sequences:
        raise UserError(f"--input {path} holds no sequences.")
    return sequences


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    from megarl.models.mcore_ckpt import check_layout
    from megarl.models.spec import load_spec

    spec = load_spec(args.hf)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_layout(spec, args.tp, args.pp)
    if world % (args.tp * args.pp):
        raise UserError(f"--tp {args.tp} x --pp {args.pp} must divide the world size {world} "
                        "(torchrun --nproc-per-node).")
    dp = world // (args.tp * args.pp)
    if args.ep < 1 or dp % args.ep or (args.ep > 1 and not spec.is_moe) or (spec.is_moe and spec.num_experts % args.ep):
        why = (f"be 1 for a dense model ({spec.hf_config.get('architectures')})" if args.ep > 1 and not spec.is_moe
               else f"divide the {dp} data-parallel replicas (world {world} / (TP x PP)) and the model's "
                    f"{spec.num_experts} experts")
        raise UserError(f"--ep {args.ep} must {why}.")
    sequences = read_sequences(args.input, spec.vocab_size)

    from megarl.platform import init_platform

    platform = init_platform()
    import torch.distributed as dist

    from megarl.distributed.parallel import ParallelDims, init_distributed, init_model_parallel, model_parallel_seed
    from megarl.models.forward import sequence_logprobs
    from megarl.models.gpt import DTYPES, BuildOptions, build_model, load_hf_weights

    init_distributed(platform)
    groups = init_model_parallel(ParallelDims(tp=args.tp, pp=args.pp, dp=dp, ep=args.ep))
    model_parallel_seed(0)
    opts = BuildOptions(dtype=DTYPES[args.dtype])
    chunks = build_model(spec, groups, opts)
    load_hf_weights(chunks, spec, args.hf, groups, opts)
    for chunk in chunks:
        chunk.eval()
    mine = list(range(groups.dp_rank, len(sequences), groups.dims.dp))
    # Under expert parallelism a replica without sequences still runs the MoE layers' exchanges.
    result = sequence_logprobs(chunks, spec, groups, [sequences[i] for i in mine],
                               micro_batch_size=args.micro_batch_size, temperature=args.temperature,
                               chunk_tokens=args.logprob_chunk_tokens) \
        if mine or args.ep > 1 else []
    payload = list(zip(mine, result, strict=True)) if result is not None and groups.tp_rank == 0 else None
    gathered: list = [None] * world if groups.rank == 0 else []
    dist.gather_object(payload, gathered if groups.rank == 0 else None, dst=0)
    if groups.rank == 0:
        rows: dict[int, list[float]] = {}
        for part in gathered:
            rows |= dict(part or [])
        assert len(rows) == len(sequences)
        bad = next((i for i in range(len(sequences)) if not all(map(math.isfinite, rows[i]))), None)
    else:
        bad = None
    # A non-finite logprob is a model or numerics failure, and NaN is not JSON: refuse to write it.
    flag = [bad]
    dist.broadcast_object_list(flag, src=0)
    if flag[0] is not None:
        raise UserError(f"scoring produced non-finite log-probabilities for sequence {flag[0] + 1} of {args.input} "
                        f"(--tp {args.tp} --pp {args.pp} --dtype {args.dtype}); nothing was written to "
                        f"{args.output}. Check the model's weights for NaN/inf"
                        + (", or score with --dtype float32." if args.dtype != "float32" else "."))
    if groups.rank == 0:
        out = Path(args.output)
        tmp = out.with_name(out.name + ".tmp")
        with open(tmp, "w") as f:
            for i in range(len(sequences)):
                f.write(json.dumps({"logprobs": rows[i]}) + "\n")
        os.replace(tmp, out)
        print(f"scored {len(sequences)} sequences ({sum(map(len, sequences))} tokens) with TP={args.tp} "
              f"PP={args.pp} DP={groups.dims.dp} EP={args.ep} in {time.perf_counter() - start:.1f}s -> {out}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
