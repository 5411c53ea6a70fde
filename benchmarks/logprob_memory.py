"""Peak memory and time of tempered log-probabilities plus entropy, forward and backward of a loss over both: from the
full logits (megarl.models.logprobs, the path of model.logprob_chunk_tokens 0) against chunked from the output
layer's input (megarl.models.chunked_logprobs).

  python benchmarks/logprob_memory.py --vocab 49152 --tokens 2048 --hidden 576 [--tp T] [--chunk 1024]
      [--device cpu|cuda] [--dtype float32|bfloat16] [--json OUT]

Both paths start from the output layer's input [tokens, hidden] and weight and end with the gradients of both.
``--tp T`` measures one TP rank: its shard of the padded vocabulary (V / T rows), the reductions over the vocab
running in a one-process group (they move [tokens]-sized vectors, nothing vocab-sized).

Peak bytes, above what the inputs already hold: on cuda ``torch.cuda.max_memory_allocated``; on cpu the process's
peak resident set (VmHWM, reset through /proc/self/clear_refs) above its resident set just before the pass. Each path
runs in a fresh process with glibc's mmap threshold fixed at 1 MiB, so that a freed tensor leaves the resident set
(glibc would otherwise raise the threshold and keep freed blocks). Times: the median of ``--repeat`` passes after one
warm-up. ``max_abs_diff``: the largest difference between the paths over logprobs, entropy and both gradients
(``max_abs_diff_by`` each, next to its largest magnitude in ``max_abs_value_by``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import time_ms  # noqa: E402

from megarl.models.chunked_logprobs import chunked_logprobs  # noqa: E402
from megarl.models.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs  # noqa: E402

TEMPERATURE = 0.8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (model.logprob_chunk_tokens)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--measure", choices=["naive", "chunked"], help=argparse.SUPPRESS)  # one path, in a child
    return parser.parse_args(argv)


def inputs(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's shard: hidden [N, H], weight [V_local, H] (padded rows past the vocab), targets, loss weights."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    padded = -(-args.vocab // (128 * args.tp)) * 128 * args.tp
    gen = torch.Generator().manual_seed(0)
    return {"hidden": torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype),
            "weight": (torch.randn(padded // args.tp, args.hidden, generator=gen) * 0.05).to(device, dtype),
            "targets": torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device),
            "g": torch.randn(args.tokens, 2, generator=gen).to(device)}


def run(path: str, args: argparse.Namespace, x: dict[str, Any]) -> list[torch.Tensor]:
    """log p, entropy and the gradients of sum(g0 * log p + g1 * H) to the hidden states and the weight."""
    hidden, weight = x["hidden"].detach().requires_grad_(), x["weight"].detach().requires_grad_()
    kw = {"vocab_start": 0, "vocab_size": args.vocab, "group": dist.group.WORLD, "temperature": TEMPERATURE}
    if path == "chunked":
        out = chunked_logprobs(hidden, weight, x["targets"], chunk_tokens=args.chunk, **kw)
        lp, ent = out[:, 0], out[:, 1]
    else:
        logits = hidden @ weight.t()
        lp, ent = vocab_parallel_logprobs(logits, x["targets"], **kw), vocab_parallel_entropy(logits, **kw)
    loss = (x["g"][:, 0] * lp + x["g"][:, 1] * ent).sum()
    return [lp.detach(), ent.detach(), *torch.autograd.grad(loss, (hidden, weight))]


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


def measure(path: str, args: argparse.Namespace) -> dict[str, float]:
    """Peak bytes above the inputs, and the median time, of one path in this (fresh) process."""
    x = inputs(args)
    device = torch.device(args.device)
    run(path, args, x)  # warm-up
    if args.device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(path, args, x)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from the current one
        base = _status("VmRSS")
        run(path, args, x)
        peak = _status("VmHWM") - base
    times = [time_ms(lambda: run(path, args, x), device, barrier=False) for _ in range(args.repeat)]
    return {"peak_bytes": peak, "ms": statistics.median(times)}


def _init_group(device: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _init_group(args.device)
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    measured = {}
    for path in ("naive", "chunked"):
        env = os.environ | {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--measure", path], env=env,
                               capture_output=True, text=True, check=True)
        measured[path] = json.loads(child.stdout.strip().splitlines()[-1])
    x = inputs(args)
    names = ("logprobs", "entropy", "grad_hidden", "grad_weight")
    pairs = dict(zip(names, zip(run("naive", args, x), run("chunked", args, x), strict=True), strict=True))
    diffs = {k: (a.double() - b.double()).abs().max().item() for k, (a, b) in pairs.items()}
    largest = {k: a.double().abs().max().item() for k, (a, _) in pairs.items()}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result = {"vocab": args.vocab, "tokens": args.tokens, "hidden": args.hidden, "tp": args.tp, "chunk": args.chunk,
              "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
              "dtype": args.dtype, "temperature": TEMPERATURE,
              "naive_peak_bytes": measured["naive"]["peak_bytes"],
              "chunked_peak_bytes": measured["chunked"]["peak_bytes"],
              "naive_ms": measured["naive"]["ms"], "chunked_ms": measured["chunked"]["ms"],
              "max_abs_diff": max(diffs.values()), "max_abs_diff_by": diffs, "max_abs_value_by": largest,
              "peak_method": "torch.cuda.max_memory_allocated" if args.device == "cuda"
              else "VmHWM - VmRSS (peak resident set, glibc mmap threshold 1 MiB)",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "commit": commit}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
