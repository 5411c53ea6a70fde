"""Vocab-parallel log-probabilities and entropy at a sampling temperature equal a float64 full-vocab
reference, in value and in each TP rank's gradient, also when a rank's vocab shard is all padding."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.models.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs

LOCAL_VOCAB = 4


def reference(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, entropy, d sum(logprobs * g) / d logits, d sum(entropy * g) / d logits) in float64."""
    full = logits.double().requires_grad_()
    logp = torch.log_softmax(full[..., :vocab_size] / temperature, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    g = torch.linspace(0.5, 1.5, targets.numel(), dtype=torch.float64).reshape(targets.shape)
    (grad_lp,) = torch.autograd.grad((chosen * g).sum(), full, retain_graph=True)
    (grad_ent,) = torch.autograd.grad((entropy * g).sum(), full)
    return chosen.detach(), entropy.detach(), grad_lp, grad_ent


def _worker(rank: int, world: int, meeting: str, vocab_size: int, temperature: float, queue: mp.Queue) -> None:
    dist.init_process_group("gloo", init_method=meeting, rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, LOCAL_VOCAB * world, generator=gen) * 3
    targets = torch.randint(0, vocab_size, (2, 3), generator=gen)
    ref_lp, ref_ent, ref_grad_lp, ref_grad_ent = reference(logits, targets, vocab_size, temperature)
    start = rank * LOCAL_VOCAB
    local = logits[..., start:start + LOCAL_VOCAB].clone().requires_grad_()
    g = torch.linspace(0.5, 1.5, targets.numel()).reshape(targets.shape)
    group = dist.group.WORLD
    lp = vocab_parallel_logprobs(local, targets, vocab_start=start, vocab_size=vocab_size, group=group,
                                 temperature=temperature)
    (grad_lp,) = torch.autograd.grad((lp * g).sum(), local)
    ent = vocab_parallel_entropy(local, vocab_start=start, vocab_size=vocab_size, group=group,
                                 temperature=temperature)
    (grad_ent,) = torch.autograd.grad((ent * g).sum(), local)
    queue.put((rank, {
        "lp": (lp.double() - ref_lp).abs().max().item(),
        "entropy": (ent.double() - ref_ent).abs().max().item(),
        "grad_lp": (grad_lp.double() - ref_grad_lp[..., start:start + LOCAL_VOCAB]).abs().max().item(),
        "grad_entropy": (grad_ent.double() - ref_grad_ent[..., start:start + LOCAL_VOCAB]).abs().max().item(),
        "finite": bool(torch.isfinite(lp).all() and torch.isfinite(ent).all()
                       and torch.isfinite(grad_lp).all() and torch.isfinite(grad_ent).all()),
    }))
    dist.destroy_process_group()


# vocab 7 of 8 columns: one padded column; vocab 3: rank 1's shard is padding only (the NaN case).
@pytest.mark.parametrize("world,vocab_size,temperature", [(1, 3, 1.0), (2, 7, 0.7), (2, 3, 1.3), (2, 8, 1.0)])
def test_vocab_parallel_logprobs_and_entropy_match_full_vocab(world, vocab_size, temperature, tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    meeting = f"file://{tmp_path / 'meeting'}"  # a port picked free can be taken before rank 0 binds it
    procs = [ctx.Process(target=_worker, args=(r, world, meeting, vocab_size, temperature, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:  # the rows are small: they fit the queue's pipe, so joining first cannot block
        p.join(timeout=120)
        assert p.exitcode == 0, p.exitcode
    results = dict(queue.get(timeout=10) for _ in procs)
    for rank, row in results.items():
        assert row["finite"], (rank, row)
        for key in ("lp", "entropy", "grad_lp", "grad_entropy"):
            assert row[key] < 1e-5, (rank, key, row)  # float32 vs float64
