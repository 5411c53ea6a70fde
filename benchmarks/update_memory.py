"""The trainer's side of an RL step with the full logits against the chunked log-probability path: peak memory and
tokens/s of scoring (old log-probabilities) and of the actor update, with the memory plan's prediction for each.

  torchrun --nproc-per-node 1 benchmarks/update_memory.py --model DIR_OR_PRESET [--num-layers N]
      [--config recipes/smollm2_gsm8k_grpo.yaml] [--chunk 0 --chunk 1024] [--tokens 32768 --tokens 65536]
      [--samples 512] [--prompt-len 100] [--response-len 140] [--steps 3] [--set KEY=VALUE ...] [--json OUT]

--model: a HF directory (its weights are loaded) or a preset name (llama3-8b: Megatron's random initialisation, its
own 128256-token vocabulary). Sequences are random tokens: a prompt of --prompt-len and a response of 0.5x to 1.5x
--response-len tokens, as in a rollout batch. Per chunk size (0 = today's full logits) and per token budget
(actor.max_tokens_per_gpu): scoring of every sample (forward only; twice, timed apart: the first pass also plans
cuDNN's attention for each micro-batch width), then --steps optimizer steps of the recipe's
actor loss over mini-batches of actor.mini_batch_size samples (the first one is a warm-up, which creates Adam's
state). Peaks are torch.cuda.max_memory_allocated over the phase, what a run logs as memory/score_trainer_gib and
memory/update_trainer_gib; the plan's figure is megarl.memory.plan's trainer tensors of the actor update (actor weights,
gradients, optimizer state and the larger of the activations and the optimizer step), with no reference model.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import sync  # noqa: E402

from megarl.platform import init_platform  # noqa: E402

GIB = 2**30


def sequences(vocab: int, n: int, prompt_len: int, response_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(response_len // 2, response_len * 3 // 2 + 1, (n,), generator=gen)
    return [torch.randint(0, vocab, (prompt_len + int(r),), generator=gen).tolist() for r in lengths]


def rl_loss(actor: Any, algo: Any, logits: torch.Tensor, tokens: torch.Tensor, ex: dict[str, torch.Tensor]) -> Any:
    """The recipe's actor loss, as Learner.update_actor builds it."""
    from megarl.loop.rl_step import actor_loss

    entropy = actor.token_entropy(logits) if algo.entropy_coef > 0 else None
    return actor_loss(actor.token_logprobs(logits, tokens), ex, algo, 0.0, entropy)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--config", default="recipes/smollm2_gsm8k_grpo.yaml")
    p.add_argument("--chunk", type=int, action="append", help="model.logprob_chunk_tokens (default: 0 and 1024)")
    p.add_argument("--tokens", type=int, action="append", help="actor.max_tokens_per_gpu (default: 32768)")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--response-len", type=int, default=140)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override, as for train.py (model.recompute_activations=true)")
    p.add_argument("--json")
    args = p.parse_args()
    chunks, budgets = args.chunk or [0, 1024], args.tokens or [32768]

    platform = init_platform()
    from megarl.algos.losses import token_weights
    from megarl.config import load_config
    from megarl.distributed.parallel import ParallelDims, init_distributed, init_model_parallel, model_parallel_seed
    from megarl.memory.plan import plan_memory
    from megarl.models.gpt import DTYPES, BuildOptions
    from megarl.models.presets import preset_or_hf_spec
    from megarl.models.trainable import MegatronModel

    init_distributed(platform)
    groups = init_model_parallel(ParallelDims(tp=1, pp=1, dp=1))
    model_parallel_seed(0)
    spec = preset_or_hf_spec(args.model, args.num_layers)
    hf_dir = args.model if Path(args.model).is_dir() and args.num_layers is None else None
    dtype = "bfloat16" if platform.is_cuda else "float32"
    seqs = sequences(spec.vocab_size, args.samples, args.prompt_len, args.response_len, seed=0)
    real_tokens = sum(len(s) for s in seqs)
    device = platform.device
    gen = torch.Generator().manual_seed(1)
    advantages = torch.randn(args.samples, generator=gen)
    results = []
    for chunk in chunks:
        for budget in budgets:
            cfg = load_config(args.config, [f"model.hf_path={hf_dir or '/unused'}", f"model.dtype={dtype}",
                                            f"model.logprob_chunk_tokens={chunk}", f"actor.max_tokens_per_gpu={budget}",
                                            "algorithm.kl_coef=0", "rollout.engine=sglang", *args.set])
            opts = BuildOptions(dtype=DTYPES[dtype], vocab_pad_multiple=cfg.model.vocab_pad_multiple,
                                logprob_chunk_tokens=chunk, recompute_activations=cfg.model.recompute_activations)
            actor = MegatronModel(spec, hf_dir, groups, opts, cfg.actor.optimizer, num_steps=args.steps,
                                  temperature=cfg.rollout.temperature)
            sync(device)
            at_rest = torch.cuda.memory_allocated() if platform.is_cuda else 0
            if platform.is_cuda:
                torch.cuda.reset_peak_memory_stats()
            # Twice: the first pass also plans cuDNN's attention for every micro-batch width, as a run's first step.
            score_times = []
            for _ in range(2):
                start = time.perf_counter()
                old = actor.score(seqs, budget)
                sync(device)
                score_times.append(time.perf_counter() - start)
            first_score_s, score_s = score_times
            score_peak = torch.cuda.max_memory_allocated() if platform.is_cuda else 0
            assert old is not None
            algo, size = cfg.algorithm, cfg.actor.mini_batch_size or args.samples
            loss = functools.partial(rl_loss, actor, algo)
            times, update_peak = [], 0
            for step in range(args.steps):
                index = [(step * size + i) % args.samples for i in range(size)]
                mb = [seqs[i] for i in index]
                mask = torch.zeros(len(mb), max(len(s) for s in mb) - 1)
                for r, s in enumerate(mb):
                    mask[r, args.prompt_len - 1: len(s) - 1] = 1
                weights = token_weights(mask, algo.loss_aggregation, cfg.rollout.max_new_tokens)
                extras = {"old_logprobs": [old[i] for i in index],
                          "advantages": [torch.full((len(s) - 1,), float(advantages[i])) * mask[r, : len(s) - 1]
                                         for r, (i, s) in enumerate(zip(index, mb, strict=True))],
                          "weights": [weights[r, : len(s) - 1] for r, s in enumerate(mb)]}
                if platform.is_cuda:
                    torch.cuda.reset_peak_memory_stats()
                sync(device)
                start = time.perf_counter()
                actor.train_step(mb, extras, loss, budget)
                sync(device)
                times.append(time.perf_counter() - start)
                if platform.is_cuda:
                    update_peak = max(update_peak, torch.cuda.max_memory_allocated())
            steady = times[1:] or times
            plan = plan_memory(cfg, spec, ParallelDims(tp=1, pp=1, dp=1), 143771 * 2**20)
            skip = ("trainer overhead", "engines asleep", "engine awake")
            planned = sum(v for k, v in plan.phases["actor_update"].items() if k not in skip)
            row = {"chunk": chunk, "max_tokens_per_gpu": budget, "at_rest_gib": at_rest / GIB,
                   "score_peak_gib": score_peak / GIB, "first_score_s": first_score_s,
                   "score_s": score_s, "score_tokens_per_s": real_tokens / score_s,
                   "update_peak_gib": update_peak / GIB, "update_step_s": sum(steady) / len(steady),
                   "update_tokens_per_s": sum(len(s) for s in seqs[:size]) * len(steady) / sum(steady),
                   "planned_update_gib": planned / GIB,
                   "plan_error": (planned - update_peak) / update_peak if update_peak else None}
            results.append(row)
            print(json.dumps(row), flush=True)
            del actor, old, loss  # the loss holds the model: kept, the next row would count its 2.3 GiB
            gc.collect()
            if platform.is_cuda:
                torch.cuda.empty_cache()
    out = {"model": args.model, "num_layers": spec.num_layers, "vocab": spec.vocab_size, "hidden": spec.hidden_size,
           "samples": args.samples, "tokens": real_tokens, "mini_batch_size": size, "dtype": dtype,
           "device": torch.cuda.get_device_name(device) if platform.is_cuda else "cpu", "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main()
