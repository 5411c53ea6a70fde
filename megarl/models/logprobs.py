"""Log-probabilities of chosen tokens from vocab-parallel logits, differentiable, without gathering the vocab."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        logits = logits.float()
        local_vocab = logits.shape[-1]
        pad_from = max(0, min(local_vocab, vocab_size - vocab_start))
        if pad_from < local_vocab:  # padded vocab rows are not tokens: they must carry no probability
            logits = logits.clone()
            logits[..., pad_from:] = float("-inf")
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < local_vocab)
        safe_t = torch.where(owned, local_t, torch.zeros_like(local_t))
        target_logit = shifted.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1) * owned
        dist.all_reduce(target_logit, group=group)

        ctx.save_for_backward(exp, sum_exp, safe_t, owned)
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        exp, sum_exp, safe_t, owned = ctx.saved_tensors
        # d logp(t) / d logit_j = 1[j == t] - softmax_j
        grad_logits = -(exp / sum_exp.unsqueeze(-1)) * grad.unsqueeze(-1)
        grad_logits.scatter_add_(-1, safe_t.unsqueeze(-1), (grad * owned).unsqueeze(-1))
        return grad_logits, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int,
                            group: dist.ProcessGroup) -> torch.Tensor:
    """log p(targets) under softmax over the full (TP-sharded) vocab.

    logits: [..., V_local] this rank's slice of the padded vocab, starting at ``vocab_start``.
    targets: [...] int64 token ids in [0, vocab_size). Returns float32 [...].
    Columns at or beyond ``vocab_size`` (Megatron's padding) are excluded from the softmax.
    """
    return _VocabParallelLogprob.apply(logits, targets, vocab_start, vocab_size, group)
