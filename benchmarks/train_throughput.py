"""Megatron training-step throughput of a model preset: tokens/s and MFU.

  torchrun --nproc-per-node W benchmarks/train_throughput.py --model llama-1b [--tp N --pp M]
      [--seq 2048 --micro-batch 4 --num-micro-batches 1 --steps 10] [--attention sdpa|unfused] [--te] [--json OUT]

One step = forward + backward over the micro-batches (Megatron's pipeline schedule), DDP grad
reduction and an Adam step (distributed optimizer), bf16 on GPU. MFU counts 6 x (parameters
outside the embedding) + 6 x layers x seq x hidden (causal attention) FLOPs per token against
``--peak-tflops`` (790, the bf16 matmul rate measured on an H200).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import percentile, slowest, sync  # noqa: E402

from megarl.platform import init_platform  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--num-micro-batches", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--attention", choices=["sdpa", "unfused"], default="sdpa",
                   help="local spec's core attention: torch's fused SDPA (megarl's) or Megatron's unfused one")
    p.add_argument("--te", action="store_true", help="Transformer Engine's layer spec (TE installed)")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--json")
    args = p.parse_args()

    platform = init_platform()
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.distributed.parallel import ParallelDims, init_distributed, init_model_parallel, model_parallel_seed
    from megarl.models.gpt import BuildOptions, build_model, layer_implementation
    from megarl.models.presets import preset_or_hf_spec

    init_distributed(platform)
    world = dist.get_world_size()
    spec = preset_or_hf_spec(args.model, args.num_layers)
    groups = init_model_parallel(ParallelDims(tp=args.tp, pp=args.pp, dp=world // (args.tp * args.pp)))
    model_parallel_seed(0)
    dtype = torch.bfloat16 if platform.is_cuda else torch.float32
    chunks = build_model(spec, groups, BuildOptions(dtype=dtype, transformer_engine=args.te,
                                                    fused_attention=args.attention == "sdpa"))
    layers = layer_implementation(chunks)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    models = [DistributedDataParallel(chunks[0].config, ddp_config, module=c) for c in chunks]
    chunks[0].config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, bf16=dtype == torch.bfloat16,
                                                 use_distributed_optimizer=True, clip_grad=1.0), models)
    device = platform.device
    gen = torch.Generator(device=device).manual_seed(groups.dp_rank)
    tokens = torch.randint(0, spec.vocab_size, (args.micro_batch, args.seq + 1), generator=gen, device=device)
    positions = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.micro_batch, -1)

    def forward_step(data, model):
        next(data)
        out = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    def batches():
        while True:
            yield None

    fb = get_forward_backward_func()
    times = []
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        for m in models:
            m.zero_grad_buffer()
        opt.zero_grad()
        fb(forward_step_func=forward_step, data_iterator=[batches() for _ in models] if len(models) > 1 else batches(),
           model=models if len(models) > 1 else models[0], num_microbatches=args.num_micro_batches,
           seq_length=args.seq, micro_batch_size=args.micro_batch, forward_only=False)
        opt.step()
        sync(device)
        times.append(time.perf_counter() - start)
    steady = slowest(times[2:], device) if len(times) > 2 else slowest(times, device)
    step_s = percentile(steady, 50)
    tokens_per_step = args.seq * args.micro_batch * args.num_micro_batches * groups.dims.dp
    flops_per_token = 6 * (spec.num_params() - spec.vocab_size * spec.hidden_size) + \
        6 * spec.num_layers * args.seq * spec.num_attention_heads * spec.head_dim
    tflops = flops_per_token * tokens_per_step / step_s / 1e12
    result = {"model": args.model, "params": spec.num_params(), "world": world, "tp": args.tp, "pp": args.pp,
              "layers": layers, "seq": args.seq, "micro_batch": args.micro_batch,
              "num_micro_batches": args.num_micro_batches,
              "device": torch.cuda.get_device_name(device) if platform.is_cuda else "cpu",
              "step_ms": step_s * 1e3, "tokens_per_s": tokens_per_step / step_s,
              "tflops_per_gpu": tflops / world, "mfu": tflops / world / args.peak_tflops}
    if dist.get_rank() == 0:
        print(f"{args.model} ({spec.num_params() / 1e9:.2f}B) [{layers}] TP{args.tp} PP{args.pp} DP{groups.dims.dp} "
              f"seq {args.seq} x mbs {args.micro_batch} x {args.num_micro_batches}: step {step_s * 1e3:.0f} ms, "
              f"{result['tokens_per_s']:.0f} tokens/s, {tflops / world:.0f} TFLOP/s/GPU, MFU {result['mfu']:.1%}",
              flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main()
