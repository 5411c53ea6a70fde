"""Tempered log-probabilities of target tokens and entropy straight from the output layer's input, a chunk of
tokens at a time, so that no [tokens x vocab] float32 tensor of the whole micro-batch ever exists.

The output layer's logits, hidden @ W.T, are made ``chunk_tokens`` rows at a time; forward keeps per token only the
global max, log Z and the entropy, and backward makes each chunk's logits again to form their gradient, which it
turns into the hidden states' and the weight's at once. The vocabulary is TP-sharded as in megarl.models.logprobs
(read its docstring): the softmax statistics are reduced over the TP group, and backward gives each rank the
gradient of its own vocab slice only; the caller reduces the hidden states' gradient over TP, as Megatron's
ColumnParallelLinear does (megarl.models.logprob_head).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _logits(hidden: torch.Tensor, weight: torch.Tensor, pad_from: int, temperature: float) -> torch.Tensor:
    """[c, V_local] tempered logits in at least float32, padded vocab columns at -inf. The product runs in the
    model's dtype, as Megatron's output layer computes it."""
    scaled = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    if temperature != 1.0:
        scaled.div_(temperature)
    if pad_from < scaled.shape[-1]:  # padded vocab rows are not tokens: they carry no probability
        scaled[:, pad_from:] = float("-inf")
    return scaled


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                vocab_size: int, temperature: float, group: dist.ProcessGroup, chunk_tokens: int) -> torch.Tensor:
        local_vocab = weight.shape[0]
        pad_from = max(0, min(local_vocab, vocab_size - vocab_start))
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < local_vocab)
        safe_t = torch.where(owned, local_t, torch.zeros_like(local_t))
        stats_dtype = torch.promote_types(hidden.dtype, torch.float32)
        row_max = torch.empty(hidden.shape[0], dtype=stats_dtype, device=hidden.device)
        log_z, out = torch.empty_like(row_max), torch.empty(hidden.shape[0], 2, dtype=stats_dtype,
                                                             device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            scaled = _logits(hidden[rows], weight, pad_from, temperature)
            top = scaled.max(dim=-1).values
            # A shard of padding only has a local max of -inf; the global max is finite (the vocab is not empty).
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            scaled.sub_(top.unsqueeze(-1))
            exp = scaled.exp()
            # where, not a product: padding has exp 0 and shifted logit -inf, and 0 * -inf is NaN.
            picked = scaled.gather(-1, safe_t[rows].unsqueeze(-1)).squeeze(-1)
            sums = torch.stack([exp.sum(dim=-1), torch.where(owned[rows], picked, torch.zeros_like(picked)),
                                torch.where(exp > 0, exp * scaled, torch.zeros_like(exp)).sum(dim=-1)])
            del scaled, exp
            dist.all_reduce(sums, group=group)  # sum of exp, target's shifted logit, sum of exp * shifted logit
            sum_exp, target, weighted = sums
            row_max[rows], log_z[rows] = top, sum_exp.log()
            out[rows, 0] = target - log_z[rows]
            out[rows, 1] = log_z[rows] - weighted / sum_exp  # H = log Z - sum_j p_j s_j
        # Kept per token: what each chunk's logits need to become probabilities again (a no-grad call drops them).
        ctx.save_for_backward(hidden, weight, safe_t, owned, row_max, log_z, out[:, 1].clone())
        ctx.pad_from, ctx.temperature, ctx.chunk_tokens = pad_from, temperature, chunk_tokens
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, safe_t, owned, row_max, log_z, entropy = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                  device=weight.device)
        grad = grad / ctx.temperature
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            log_p = _logits(hidden[rows], weight, ctx.pad_from, ctx.temperature)
            log_p.sub_((row_max[rows] + log_z[rows]).unsqueeze(-1))
            probs = log_p.exp()
            g_lp, g_ent = grad[rows, 0].unsqueeze(-1), grad[rows, 1].unsqueeze(-1)
            # d log p_t / d z_j = (1[j == t] - p_j) / T and dH / d z_j = -p_j (log p_j + H) / T; padding has p_j = 0
            # and log p_j = -inf, left out explicitly.
            log_p.add_(entropy[rows].unsqueeze(-1)).mul_(g_ent).add_(g_lp)
            grad_logits = torch.where(probs > 0, log_p, torch.zeros_like(log_p)).mul_(probs).neg_()
            del log_p, probs
            grad_logits.scatter_add_(-1, safe_t[rows].unsqueeze(-1), g_lp * owned[rows].unsqueeze(-1))
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[rows] = grad_logits @ weight
            grad_weight += grad_logits.t() @ hidden[rows]
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, vocab_start: int,
                     vocab_size: int, group: dist.ProcessGroup, temperature: float = 1.0,
                     chunk_tokens: int = 1024) -> torch.Tensor:
    """[N, 2]: log p(targets) and the entropy of softmax(hidden @ weight.T / temperature) over the full
    (TP-sharded) vocab, in at least float32.

    hidden: [N, H] the output layer's input (every token of the micro-batch, sequence-parallel shards gathered);
    weight: [V_local, H] this rank's slice of the padded vocab, starting at ``vocab_start``; targets: [N] int64 in
    [0, vocab_size). Rows at or beyond ``vocab_size`` (Megatron's padding) carry no probability. The gradient
    reaching ``hidden`` is this rank's vocab slice's share only (reduce it over TP); ``weight``'s is its own.
    """
    assert temperature > 0, "greedy decoding has no log-probabilities to train on"
    assert chunk_tokens > 0, chunk_tokens
    return _ChunkedLogprobs.apply(hidden, weight, targets, vocab_start, vocab_size, temperature, group,
                                  chunk_tokens)
