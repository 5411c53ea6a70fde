"""Tempered log-probabilities of target tokens and entropy straight from the output layer's input, a chunk of tokens at
a time, so that no [tokens x vocab] float32 tensor of the whole micro-batch ever exists.

The output layer's logits, hidden @ W.T, are made ``chunk_tokens`` rows at a time; forward keeps per token only the
global max plus log Z and the entropy (and returns the most likely token beside them), and backward makes each
chunk's logits again to form their gradient, which it turns into the hidden states' and the weight's at once (the
weight's summed over chunks in float32, then returned in its dtype; none for a frozen weight). The vocabulary is
TP-sharded as in megarl.models.logprobs (read its docstring): the softmax statistics are reduced over the TP group,
and backward gives each rank the gradient of its own vocab slice only; the caller reduces the hidden states'
gradient over TP, as Megatron's ColumnParallelLinear does (megarl.models.logprob_head).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[c, V] tempered logits in at least float32. The product runs in the model's dtype, as Megatron's output layer
    computes it."""
    scaled = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    if temperature != 1.0:
        scaled.div_(temperature)
    return scaled


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                vocab_size: int, temperature: float, group: dist.ProcessGroup, chunk_tokens: int) -> torch.Tensor:
        # Padded vocab rows are not tokens: they carry no probability, so their logits are never made.
        real = weight[: max(0, min(weight.shape[0], vocab_size - vocab_start))]
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < real.shape[0])
        safe_t = torch.where(owned, local_t, torch.zeros_like(local_t))
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        row_max = torch.full((hidden.shape[0],), float("-inf"), dtype=dtype, device=hidden.device)
        out = torch.zeros(hidden.shape[0], 3, dtype=dtype, device=hidden.device)
        log_z = torch.zeros_like(row_max)
        shared = dist.get_world_size(group) > 1  # vocab split over TP ranks; alone, two calls a chunk saved
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            sums = torch.zeros(4, len(row_max[rows]), dtype=dtype, device=hidden.device)
            # A shard of padding only keeps a max of -inf and zero sums; the global max is finite.
            scaled = _logits(hidden[rows], real, temperature) if real.shape[0] else None
            if scaled is not None:
                local_max, local_top = scaled.max(dim=-1)
                row_max[rows] = local_max
            if shared:
                dist.all_reduce(row_max[rows], op=dist.ReduceOp.MAX, group=group)
            if scaled is not None:
                scaled.sub_(row_max[rows].unsqueeze(-1))
                exp = scaled.exp()
                picked = scaled.gather(-1, safe_t[rows].unsqueeze(-1)).squeeze(-1)
                sums[0], sums[2] = exp.sum(dim=-1), (exp * scaled).sum(dim=-1)
                sums[1] = torch.where(owned[rows], picked, torch.zeros_like(picked))
                # The most likely token, id + 1 from the shard that holds the global max, 0 from the others (an
                # exact tie across shards would add two ids: a float tie between different rows of weights).
                sums[3] = torch.where(local_max == row_max[rows], (local_top + vocab_start + 1).to(dtype), 0.0)
                del scaled, exp
            # Sum of exp, target's shifted logit, sum of exp * shifted logit, top-1 token + 1.
            if shared:
                dist.all_reduce(sums, group=group)
            sum_exp, target, weighted, top = sums
            log_z[rows] = sum_exp.log()
            out[rows, 0] = target - log_z[rows]
            out[rows, 1] = log_z[rows] - weighted / sum_exp  # H = log Z - sum_j p_j s_j
            out[rows, 2] = top - 1
        # Kept per token: what each chunk's logits need to become probabilities again (a no-grad call drops them).
        ctx.save_for_backward(hidden, weight, safe_t, owned, row_max + log_z, out[:, 1].clone())
        ctx.real, ctx.temperature, ctx.chunk_tokens = real.shape[0], temperature, chunk_tokens
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, safe_t, owned, shift, entropy = ctx.saved_tensors
        real = weight[: ctx.real]
        grad_hidden = torch.zeros_like(hidden)
        # A frozen weight (LoRA's base) gets no gradient: no [V, H] float32 sum, a third fewer backward FLOPs.
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                  device=weight.device) if ctx.needs_input_grad[1] else None
        grad = grad / ctx.temperature
        for start in range(0, hidden.shape[0] if ctx.real else 0, ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            log_p = _logits(hidden[rows], real, ctx.temperature).sub_(shift[rows].unsqueeze(-1))
            probs = log_p.exp()
            g_lp, g_ent = grad[rows, 0].unsqueeze(-1), grad[rows, 1].unsqueeze(-1)
            # d log p_t / d z_j = (1[j == t] - p_j) / T and dH / d z_j = -p_j (log p_j + H) / T.
            grad_logits = log_p.mul_(-g_ent).sub_(g_ent * entropy[rows].unsqueeze(-1) + g_lp).mul_(probs)
            del probs
            grad_logits.scatter_add_(-1, safe_t[rows].unsqueeze(-1), g_lp * owned[rows].unsqueeze(-1))
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[rows] = grad_logits @ real
            if grad_weight is not None:
                grad_weight[: ctx.real] += grad_logits.t() @ hidden[rows]
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None, None)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, vocab_start: int,
                     vocab_size: int, group: dist.ProcessGroup, temperature: float = 1.0,
                     chunk_tokens: int = 1024) -> torch.Tensor:
    """[N, 3]: log p(targets), the entropy of softmax(hidden @ weight.T / temperature) over the full (TP-sharded)
    vocab, in at least float32, and the most likely token (its id as a float; no gradient).

    hidden: [N, H] the output layer's input (every token of the micro-batch, sequence-parallel shards gathered);
    weight: [V_local, H] this rank's slice of the padded vocab, starting at ``vocab_start``; targets: [N] int64 in
    [0, vocab_size). Rows at or beyond ``vocab_size`` (Megatron's padding) carry no probability. The gradient
    reaching ``hidden`` is this rank's vocab slice's share only (reduce it over TP); ``weight``'s is its own.
    """
    assert temperature > 0, "greedy decoding has no log-probabilities to train on"
    assert chunk_tokens > 0, chunk_tokens
    return _ChunkedLogprobs.apply(hidden, weight, targets, vocab_start, vocab_size, temperature, group,
                                  chunk_tokens)
