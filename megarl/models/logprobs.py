"""Log-probabilities and entropy of a tempered softmax over vocab-parallel logits, differentiable,
without gathering the vocabulary.

Each TP rank holds [..., V_local] logits, its slice of Megatron's padded vocabulary. The softmax
statistics (max, sum of exponentials, and for the entropy sum of p * logit) are reduced over the
TP group in forward; backward returns each rank the gradient of its own slice only. Every TP rank
computes the same loss from these, and Megatron's output layer reduces the input gradient over
TP, so a backward that also summed over TP would multiply the gradient by TP.

Logits are divided by ``temperature`` first: the engine samples from softmax(logits / T), and the
importance ratios, clip range and entropy must refer to that distribution.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _stats(logits: torch.Tensor, vocab_start: int, vocab_size: int, temperature: float,
           group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shifted logits z / T - global max [..., V_local] with padding at -inf, exp of them, global sum_exp [...])."""
    scaled = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        scaled.div_(temperature)
    local_vocab = scaled.shape[-1]
    pad_from = max(0, min(local_vocab, vocab_size - vocab_start))
    if pad_from < local_vocab:  # padded vocab rows are not tokens: they must carry no probability
        scaled[..., pad_from:] = float("-inf")
    row_max = scaled.max(dim=-1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    # A shard of padding only has a local max of -inf; the global max is finite (the vocab is not empty).
    scaled.sub_(row_max.unsqueeze(-1))
    exp = scaled.exp()
    sum_exp = exp.sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return scaled, exp, sum_exp


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
                temperature: float, group: dist.ProcessGroup) -> torch.Tensor:
        shifted, exp, sum_exp = _stats(logits, vocab_start, vocab_size, temperature, group)
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < shifted.shape[-1])
        safe_t = torch.where(owned, local_t, torch.zeros_like(local_t))
        # where, not a product with `owned`: column 0 of a padding-only shard is -inf, and -inf * 0 is NaN.
        picked = shifted.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(owned, picked, torch.zeros_like(picked))
        dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(exp, sum_exp, safe_t, owned)
        ctx.temperature = temperature
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        exp, sum_exp, safe_t, owned = ctx.saved_tensors
        # d logp(t) / d z_j = (1[j == t] - softmax_j) / T
        grad = grad / ctx.temperature
        grad_logits = -(exp / sum_exp.unsqueeze(-1)) * grad.unsqueeze(-1)
        grad_logits.scatter_add_(-1, safe_t.unsqueeze(-1), (grad * owned).unsqueeze(-1))
        return grad_logits, None, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, vocab_start: int, vocab_size: int, temperature: float,
                group: dist.ProcessGroup) -> torch.Tensor:
        shifted, exp, sum_exp = _stats(logits, vocab_start, vocab_size, temperature, group)
        # H = log Z - sum_j p_j * s_j with s = shifted logits and Z = sum_j exp(s_j); padding has p = 0
        # and s = -inf, so it is left out explicitly (0 * -inf is NaN).
        weighted = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp)).sum(dim=-1)
        dist.all_reduce(weighted, group=group)
        entropy = sum_exp.log() - weighted / sum_exp
        ctx.save_for_backward(shifted, sum_exp, entropy)  # exp is recomputed: one vocab-sized tensor kept, not two
        ctx.temperature = temperature
        return entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shifted, sum_exp, entropy = ctx.saved_tensors
        exp = shifted.exp()
        # dH / d z_j = -p_j * (log p_j + H) / T, with log p_j = s_j - log Z; 0 on padding (p_j = 0).
        probs = exp / sum_exp.unsqueeze(-1)
        log_probs = shifted - sum_exp.log().unsqueeze(-1)
        inner = torch.where(exp > 0, log_probs + entropy.unsqueeze(-1), torch.zeros_like(log_probs))
        grad_logits = -probs * inner * (grad / ctx.temperature).unsqueeze(-1)
        return grad_logits, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int,
                            group: dist.ProcessGroup, temperature: float = 1.0) -> torch.Tensor:
    """log p(targets) under softmax(logits / temperature) over the full (TP-sharded) vocab.

    logits: [..., V_local] this rank's slice of the padded vocab, starting at ``vocab_start``.
    targets: [...] int64 token ids in [0, vocab_size). Returns float32 [...].
    Columns at or beyond ``vocab_size`` (Megatron's padding) are excluded from the softmax.
    """
    assert temperature > 0, "greedy decoding has no log-probabilities to train on"
    return _VocabParallelLogprob.apply(logits, targets, vocab_start, vocab_size, temperature, group)


def vocab_parallel_entropy(logits: torch.Tensor, *, vocab_start: int, vocab_size: int, group: dist.ProcessGroup,
                           temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the full (TP-sharded) vocab, float32 [...].

    logits: [..., V_local] as in ``vocab_parallel_logprobs``; padded columns are excluded.
    """
    assert temperature > 0, "greedy decoding has no distribution to take the entropy of"
    return _VocabParallelEntropy.apply(logits, vocab_start, vocab_size, temperature, group)


def vocab_parallel_top1(logits: torch.Tensor, *, vocab_start: int, vocab_size: int, group: dist.ProcessGroup
                        ) -> torch.Tensor:
    """The most likely token over the full (TP-sharded) vocab, int64 [...]; ties go to the smallest id.

    logits: [..., V_local] as in ``vocab_parallel_logprobs``; padded columns are excluded."""
    real = logits[..., : max(0, min(logits.shape[-1], vocab_size - vocab_start))].float()
    local_max = real.max(dim=-1).values if real.shape[-1] else logits.new_full(logits.shape[:-1], float("-inf"))
    row_max = local_max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    none = torch.iinfo(torch.int64).max
    mine = (real == row_max.unsqueeze(-1)).int().argmax(dim=-1) + vocab_start if real.shape[-1] else None
    top = torch.where(local_max == row_max, mine, none) if mine is not None else torch.full_like(
        row_max, none, dtype=torch.int64)
    dist.all_reduce(top, op=dist.ReduceOp.MIN, group=group)
    return top
