"""Actor update throughput on an RL-like mix of sequence lengths: packed rows against one padded sequence per row.

  torchrun --nproc-per-node W benchmarks/packing_throughput.py --model HF_DIR [--num-sequences 64]
      [--max-tokens 16384] [--steps 4] [--te] [--json OUT]

The actor's real update (MegatronModel.train_step: token-budget micro-batches, distributed Adam, bf16 on GPU)
over one batch of sequences whose lengths look like a reasoning RL step: prompts of 64-512 tokens and
responses drawn log-uniformly from 32 to 3,584 tokens (a few long ones, many short). Both modes see the same
sequences and token budget; "padded" gives each sequence a row of its own, "packed" puts several in a row
(megarl's default: on the local spec FlexAttention keeps them apart, with ``--te`` Transformer Engine's attention
over the rows laid end to end in THD format). Reports real (non-padding) tokens/s, the padding
share and the peak memory of each, and the packed/padded speed ratio measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import percentile, sync  # noqa: E402

from megarl.platform import init_platform  # noqa: E402


def rl_lengths(num: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(64, 513, (num,), generator=gen)
    responses = torch.exp(torch.empty(num).uniform_(math.log(32), math.log(3584), generator=gen)).long()
    return (prompts + responses).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF directory (benchmarks/make_random_model.py writes one)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-sequences", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16384, help="token slots per micro-batch (max_tokens_per_gpu)")
    p.add_argument("--steps", type=int, default=4, help="timed updates per mode, after one warm-up")
    p.add_argument("--te", action="store_true", help="Transformer Engine's layer spec (packed rows in THD format)")
    p.add_argument("--json")
    args = p.parse_args()

    platform = init_platform()
    import torch.distributed as dist

    from megarl.config import OptimizerConfig
    from megarl.distributed.parallel import ParallelDims, init_distributed, init_model_parallel, model_parallel_seed
    from megarl.models.gpt import BuildOptions, layer_implementation
    from megarl.models.spec import load_spec
    from megarl.models.trainable import MegatronModel

    init_distributed(platform)
    world = dist.get_world_size()
    spec = load_spec(args.model)
    groups = init_model_parallel(ParallelDims(tp=args.tp, pp=1, dp=world // args.tp))
    model_parallel_seed(0)
    dtype = torch.bfloat16 if platform.is_cuda else torch.float32
    actor = MegatronModel(spec, args.model, groups, BuildOptions(dtype=dtype, sequence_parallel=args.tp > 1,
                                                                 transformer_engine=args.te),
                          OptimizerConfig(lr=1e-6))
    packed_format = actor.packing
    lengths = rl_lengths(args.num_sequences, seed=groups.dp_rank)
    gen = torch.Generator().manual_seed(1 + groups.dp_rank)
    sequences = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    weights = [torch.full((n - 1,), 1.0 / sum(lengths)) for n in lengths]

    def loss(logits, tokens, extras):
        logp = actor.token_logprobs(logits, tokens)
        return -(logp * extras["weights"]).sum(), {}

    result = {"model": args.model, "layers": spec.num_layers, "world": world, "tp": args.tp,
              "num_sequences": args.num_sequences, "tokens_per_rank": sum(lengths), "longest": max(lengths),
              "max_tokens": args.max_tokens, "layer_classes": layer_implementation(actor.chunks),
              "packed_format": packed_format,
              "device": torch.cuda.get_device_name() if platform.is_cuda else "cpu"}
    if dist.get_rank() == 0:
        print(f"layers: {result['layer_classes']}; packed rows as {packed_format}", flush=True)
    for mode in ("padded", "packed"):
        actor.packing = packed_format if mode == "packed" else "off"
        if platform.is_cuda:
            torch.cuda.reset_peak_memory_stats()
        times, metrics = [], {}
        for _ in range(args.steps + 1):
            sync(platform.device)
            start = time.perf_counter()
            metrics = actor.train_step(sequences, {"weights": weights}, loss, args.max_tokens)
            sync(platform.device)
            times.append(time.perf_counter() - start)
        step_s = percentile(times[1:], 50)
        result[mode] = {"step_ms": step_s * 1e3, "tokens_per_s": sum(lengths) * groups.dims.dp / step_s,
                        "padding_fraction": metrics["padding_fraction"],
                        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if platform.is_cuda else None}
        if dist.get_rank() == 0:
            r = result[mode]
            print(f"{mode}: step {r['step_ms']:.0f} ms, {r['tokens_per_s']:.0f} real tokens/s, padding "
                  f"{r['padding_fraction']:.1%}, peak {r['peak_gib'] or 0:.1f} GiB", flush=True)
    result["packed_speedup"] = result["padded"]["step_ms"] / result["packed"]["step_ms"]
    if dist.get_rank() == 0:
        print(f"packed / padded tokens/s: {result['packed_speedup']:.2f}x", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main()
