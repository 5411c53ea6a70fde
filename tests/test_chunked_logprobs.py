"""Chunked log-probabilities, entropy and most likely token from the output layer's input equal a float64 reference
written out plainly and today's full-logits path (megarl.models.logprobs), in value, loss and the gradients of the
hidden states and the weight, at a temperature, with padded vocab rows, over one and two TP ranks, with chunks that do
not divide the tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.models.chunked_logprobs import chunked_logprobs
from megarl.models.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs, vocab_parallel_top1

TOKENS, HIDDEN, LOCAL_VOCAB = 13, 16, 12


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
              temperature: float, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Everything in float64 from the whole vocab: log p, entropy, loss = sum(g0 * log p + g1 * H), its gradients."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    z = (h @ w.t())[:, :vocab_size] / temperature
    log_p = z - z.exp().sum(-1, keepdim=True).log()
    chosen = log_p[torch.arange(len(targets)), targets]
    entropy = -(log_p.exp() * log_p).sum(-1)
    loss = (g[:, 0] * chosen + g[:, 1] * entropy).sum()
    grad_h, grad_w = torch.autograd.grad(loss, (h, w))
    return {"lp": chosen.detach(), "entropy": entropy.detach(), "loss": loss.detach(), "grad_h": grad_h,
            "grad_w": grad_w}


def _worker(rank: int, world: int, meeting: str, vocab_size: int, temperature: float, chunk: int, queue: mp.Queue,
            dtype: torch.dtype = torch.float32) -> None:
    dist.init_process_group("gloo", init_method=meeting, rank=rank, world_size=world)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    weight = torch.randn(LOCAL_VOCAB * world, HIDDEN, generator=gen) * 0.5
    targets = torch.randint(0, vocab_size, (TOKENS,), generator=gen)
    g = torch.randn(TOKENS, 2, generator=gen)
    ref = reference(hidden, weight, targets, vocab_size, temperature, g)
    start = rank * LOCAL_VOCAB
    rows = slice(start, start + LOCAL_VOCAB)
    kw = {"vocab_start": start, "vocab_size": vocab_size, "group": group, "temperature": temperature}

    def run(chunked: bool) -> dict[str, torch.Tensor]:
        h = hidden.to(dtype).requires_grad_()
        w = weight[rows].to(dtype).requires_grad_()
        if chunked:
            out = chunked_logprobs(h, w, targets, chunk_tokens=chunk, **kw)
            lp, ent = out[:, 0], out[:, 1]
        else:
            logits = h @ w.t()
            lp, ent = vocab_parallel_logprobs(logits, targets, **kw), vocab_parallel_entropy(logits, **kw)
        loss = (g[:, 0] * lp + g[:, 1] * ent).sum()
        grad_h, grad_w = torch.autograd.grad(loss, (h, w))
        dist.all_reduce(grad_h, group=group)  # the caller's part: ColumnParallelLinear's input gradient
        return {"lp": lp.detach(), "entropy": ent.detach(), "loss": loss.detach(), "grad_h": grad_h, "grad_w": grad_w}

    chunked, full = run(True), run(False)
    with torch.no_grad():
        scored = chunked_logprobs(hidden.to(dtype), weight[rows].to(dtype), targets, chunk_tokens=chunk, **kw)
        top1 = vocab_parallel_top1(hidden.to(dtype) @ weight[rows].to(dtype).t(), vocab_start=start,
                                   vocab_size=vocab_size, group=group)
    best = (hidden.double() @ weight.double().t())[:, :vocab_size].argmax(-1)  # the most likely token, float64
    ref["grad_w"] = ref["grad_w"][rows]
    queue.put((rank, {
        "vs_float64": {k: (chunked[k].double() - ref[k]).abs().max().item() for k in ref},
        "vs_full": {k: (chunked[k].float() - full[k].float()).abs().max().item() for k in ref},
        "grad_dtypes": [str(chunked["grad_h"].dtype), str(chunked["grad_w"].dtype)],
        "no_grad": (scored[:, 0] - chunked["lp"]).abs().max().item(),
        "top1": [scored[:, 2].long().tolist(), top1.tolist(), best.tolist()],
        "finite": all(bool(t.isfinite().all()) for t in chunked.values()),
        "scale": {k: ref[k].abs().max().item() for k in ref},
    }))
    dist.destroy_process_group()


def _run(tmp_path: Path, world: int, vocab_size: int, temperature: float, chunk: int, dtype: torch.dtype
         ) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    meeting = f"file://{tmp_path / 'meeting'}"  # a port picked free can be taken before rank 0 binds it
    procs = [ctx.Process(target=_worker, args=(r, world, meeting, vocab_size, temperature, chunk, queue, dtype))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:  # the rows are small: they fit the queue's pipe, so joining first cannot block
        p.join(timeout=120)
        assert p.exitcode == 0, p.exitcode
    return dict(queue.get(timeout=10) for _ in procs)


# 13 tokens in chunks of 5 (a short last one), 1 and more than all; vocab 21 of 24 (world 2: rank 1 holds 9 tokens
# and 3 padded rows) and 10 (rank 1's shard is padding only, where a local max is -inf).
@pytest.mark.parametrize("world,vocab_size,temperature,chunk", [(1, 9, 0.7, 5), (1, 12, 1.0, 1), (2, 21, 0.7, 5),
                                                                (2, 10, 1.3, 64), (2, 24, 1.0, 4)])
def test_chunked_logprobs_match_float64_and_full_logits(world, vocab_size, temperature, chunk, tmp_path):
    results = _run(tmp_path, world, vocab_size, temperature, chunk, torch.float32)
    # Nothing vanishes trivially (a shard of padding only has no weight gradient: some rank's has one).
    assert all(max(row["scale"][k] for row in results.values()) > 0.1 for k in ("lp", "grad_h", "grad_w")), results
    for rank, row in results.items():
        assert row["finite"], (rank, row)
        assert row["no_grad"] == 0, (rank, row)
        chunked_top1, full_top1, best = row["top1"]
        assert chunked_top1 == full_top1 == best, (rank, row["top1"])
        for key in ("lp", "entropy", "loss", "grad_h", "grad_w"):
            assert row["vs_float64"][key] < 1e-6 * max(1.0, row["scale"][key]), (rank, key, row)
            assert row["vs_full"][key] < 1e-6 * max(1.0, row["scale"][key]), (rank, key, row)


def test_bfloat16_gradients_keep_the_model_dtype_and_match_full_logits(tmp_path):
    """As Megatron's output layer: the product in bfloat16, the statistics in float32, gradients back in bfloat16;
    against the full-logits path within bfloat16 rounding (the weight's gradient rounds per chunk)."""
    results = _run(tmp_path, 2, 21, 0.7, 5, torch.bfloat16)
    for rank, row in results.items():
        assert row["finite"] and row["no_grad"] == 0, (rank, row)
        assert row["grad_dtypes"] == ["torch.bfloat16", "torch.bfloat16"], (rank, row)
        for key in ("lp", "entropy", "loss", "grad_h", "grad_w"):
            assert row["vs_full"][key] < 1e-2 * max(1.0, row["scale"][key]), (rank, key, row)  # measured 4e-3


def _frozen_worker(rank: int, world: int, meeting: str, queue: mp.Queue) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        """The shapes of the floating-point tensors each op makes."""

        def __init__(self) -> None:
            super().__init__()
            self.made: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            self.made += [tuple(t.shape) for t in (out if isinstance(out, tuple | list) else [out])
                          if isinstance(t, torch.Tensor) and t.is_floating_point()]
            return out

    dist.init_process_group("gloo", init_method=meeting, rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    weight = torch.randn(LOCAL_VOCAB, HIDDEN, generator=gen) * 0.5
    targets = torch.randint(0, 11, (TOKENS,), generator=gen)
    g = torch.randn(TOKENS, 2, generator=gen)
    ref = reference(hidden, weight, targets, 11, 0.7, g)
    h = hidden.clone().requires_grad_()
    out = chunked_logprobs(h, weight, targets, vocab_start=0, vocab_size=11, group=dist.group.WORLD,
                           temperature=0.7, chunk_tokens=5)
    loss = (g[:, 0] * out[:, 0] + g[:, 1] * out[:, 1]).sum()
    with Shapes() as shapes:
        loss.backward()
    queue.put({"grad_h": float((h.grad.double() - ref["grad_h"]).abs().max()),
               "weight_sized": shapes.made.count((LOCAL_VOCAB, HIDDEN))})
    dist.destroy_process_group()


def test_a_frozen_weight_gets_no_gradient_and_the_hidden_states_the_same(tmp_path):
    """LoRA freezes the output layer: backward gives the hidden states their float64 gradient and makes no tensor
    of the weight's shape (the float32 sum and its copy in the weight's dtype)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_frozen_worker, args=(0, 1, f"file://{tmp_path / 'meeting'}", queue))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 0, proc.exitcode
    row = queue.get(timeout=10)
    assert row["grad_h"] < 1e-6 and row["weight_sized"] == 0, row
