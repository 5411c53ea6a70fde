"""A Megatron model in an RL role: the actor and critic train, the reference only scores.

Sequences are grouped into token-budget micro-batches (``plan_micro_batches``), several short ones
packed into each row, each attending only to itself (megarl.models.forward); per-token tensors are aligned with the
*predicted* tokens (positions 1..L-1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megarl.config import OptimizerConfig
from megarl.data.batching import MicroBatch, build_micro_batches, plan_micro_batches
from megarl.distributed.parallel import ParallelGroups
from megarl.errors import check_finite
from megarl.models import logprob_head
from megarl.models.adapters import Adapters
from megarl.models.forward import (
    even_micro_batches,
    forward_only,
    micro_batches,
    model_inputs,
    output_rows,
    schedule_shape,
)
from megarl.models.gpt import BuildOptions, build_model, canonical_params, chunk_layer_offset, load_hf_weights, unwrap
from megarl.models.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs, vocab_parallel_top1
from megarl.models.optimizer_state import OptimizerState
from megarl.models.routing import RoutingReplay, place_routing
from megarl.models.spec import ModelSpec
from megarl.models.state import ModelState

# loss_fn(output [b, L, *], tokens [b, L], extras {name: [b, L-1]}) -> (weighted loss sum, metrics)
LossFn = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class MegatronModel:
    """Actor, reference or critic: Megatron chunks, and for trainable roles DDP plus optimizer.

    The learning-rate schedule runs in optimizer steps: ``num_steps`` RL steps of ``updates_per_step``
    optimizer steps each (UpdateConfig.optimizer_steps), with ``optim.num_warmup_steps`` RL steps of warm-up.
    ``temperature`` is the sampling temperature T of the rollout: log-probabilities and entropies are
    those of softmax(logits / T), the distribution the engine sampled from. With ``routing_replay`` (MoE)
    ``score`` and ``train_step`` take each sequence's expert choices and the routers replay them
    (megarl.models.routing).
    """

    def __init__(self, spec: ModelSpec, hf_dir: str | None, groups: ParallelGroups, opts: BuildOptions,
                 optim: OptimizerConfig | None = None, num_steps: int = 1, temperature: float = 1.0,
                 routing_replay: bool = False, updates_per_step: int = 1, adapters: Adapters | None = None,
                 load: Callable[[list[torch.nn.Module]], None] | None = None) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        if temperature <= 0:
            raise ValueError(f"MegatronModel: temperature {temperature} must be > 0 (greedy has no logprobs)")
        self.spec, self.groups, self.opts, self.temperature = spec, groups, opts, temperature
        self.hf_dir = hf_dir
        self.packing = opts.packed_format()
        """How sequences share rows under a token budget (BuildOptions.packing): "thd", "segments" or "off" (one
        each, right-padded)."""
        self.chunks = build_model(spec, groups, opts)
        if load is not None:  # weights of another form (a reward model's body and head), before the optimizer's copy
            load(self.chunks)
        elif hf_dir is not None:  # None: Megatron's random initialisation, for benchmarks of a model's shape
            load_hf_weights(self.chunks, spec, hf_dir, groups, opts)
        self.adapters = adapters
        """actor.lora: adapters train, the base weights are frozen (megarl.lora.training.LoraAdapters)."""
        if adapters is not None:
            adapters.install(self.chunks, [chunk_layer_offset(spec, groups, vp) for vp in range(len(self.chunks))])
        self.chunked = bool(opts.logprob_chunk_tokens) and not opts.critic
        """The last stage outputs [b, L, 3] (log p of the next token, entropy, the most likely token) instead of logits
        (megarl.models.logprob_head)."""
        if self.chunked:
            logprob_head.install(self.chunks, vocab_start=self._vocab_start(), vocab_size=spec.vocab_size,
                                 temperature=temperature, chunk_tokens=opts.logprob_chunk_tokens,
                                 group=groups.tp_group)
        assert not routing_replay or spec.is_moe, "routing replay needs an MoE model"
        self.replay = RoutingReplay(
            self.chunks, [chunk_layer_offset(spec, groups, vp) for vp in range(len(self.chunks))],
            recompute=opts.recompute_activations, sequence_parallel=opts.sequence_parallel,
            tp_rank=groups.tp_rank, tp=groups.dims.tp, thd=self.packing == "thd") if routing_replay else None
        self.optimizer: Any = None
        self.models: list[torch.nn.Module] = list(self.chunks)
        if optim is None:
            for chunk in self.chunks:
                chunk.eval()
                chunk.requires_grad_(False)
            return
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                            use_distributed_optimizer=optim.use_distributed_optimizer)
        self.models = [DistributedDataParallel(c.config, ddp, module=c) for c in self.chunks]
        config: Any = self.chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = _optimizer(self.models, optim, opts.dtype)
        self.scheduler = lr_scheduler(self.optimizer, optim, num_steps, updates_per_step)
        self.updates_per_step = updates_per_step
        # float16 trains with a dynamic loss scale: the optimizer unscales the gradients, so the
        # schedule must scale the loss up first (as Megatron's own training loop sets it).
        config.grad_scale_func = self.optimizer.scale_loss

    def named_params(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by canonical Megatron name (what the resharder reads); with LoRA the adapted
        weights are the merged W + s B A, as of the last ``refresh_merged``."""
        params = canonical_params(self.chunks, self.spec, self.groups)
        if self.adapters is not None:
            return self.adapters.merged(params)
        return {name: p.data for name, p in params.items()}

    def base_params(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by canonical Megatron name as loaded: with LoRA the frozen base weights W, without
        the adapters (what an engine serving the adapters itself holds, actor.lora.handover: adapter)."""
        return {name: p.data for name, p in canonical_params(self.chunks, self.spec, self.groups).items()}

    def adapter_params(self) -> dict[str, torch.nn.Parameter]:
        """LoRA: this rank's adapter factors by canonical name (none without LoRA)."""
        return {} if self.adapters is None else self.adapters.params()

    def refresh_merged(self) -> None:
        """LoRA: write the current W + s B A into the tensors ``named_params`` returns (before a hand-over)."""
        if self.adapters is not None:
            self.adapters.refresh_merged()

    def base_model(self) -> AbstractContextManager[None]:
        """Inside the block the model is its base (LoRA adapters off): the reference policy of a LoRA actor."""
        return self.adapters.disabled() if self.adapters is not None else nullcontext()

    def state(self) -> ModelState:
        """What a checkpoint saves and restores (megarl.checkpoint): the current weights (a LoRA actor's merged
        ones refreshed first), the optimizer's state, and the adapters' (with their optimizer state)."""
        self.refresh_merged()
        optimizer = None
        if self.optimizer is not None:
            optimizer = OptimizerState(self.optimizer, self.scheduler,
                                       canonical_params(self.chunks, self.spec, self.groups), self.updates_per_step)
        parts = (self.adapters.state_part(),) if self.adapters is not None and optimizer else ()
        return ModelState(spec=self.spec, groups=self.groups, hf_dir=self.hf_dir, critic=self.opts.critic,
                          vocab_pad_multiple=self.opts.vocab_pad_multiple, weights=self.named_params(),
                          optimizer=optimizer, parts=parts)

    def _micro_batches(self, sequences: Sequence[Sequence[int]], max_tokens: int | None,
                       micro_batch_size: int) -> list[MicroBatch]:
        """Token-budget micro-batches of at most ``max_tokens`` token slots, or with ``max_tokens`` None
        fixed ones of ``micro_batch_size`` sequences padded to the longest."""
        # Sequence parallelism splits every row over the TP ranks.
        multiple = self.groups.dims.tp if self.opts.sequence_parallel else 1
        if max_tokens is None:
            return even_micro_batches(micro_batches(sequences, micro_batch_size, multiple), self.groups, multiple)
        layout = plan_micro_batches([len(s) for s in sequences], max_tokens, uniform=self.groups.dims.pp > 1,
                                    pack=self.packing != "off", width_multiple=multiple)
        return even_micro_batches(build_micro_batches(sequences, layout), self.groups, multiple)

    def _vocab_start(self) -> int:
        padded = self.spec.padded_vocab_size(self.groups.dims.tp, self.opts.vocab_pad_multiple)
        return self.groups.tp_rank * padded // self.groups.dims.tp

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[b, L, V_local] logits (or the chunked head's [b, L, 3]), [b, L] tokens -> [b, L-1] log p(token_t | prefix)
        at the sampling temperature."""
        if self.chunked:
            return logits[:, :-1, 0]
        return vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab_start=self._vocab_start(),
                                       vocab_size=self.spec.vocab_size, group=self.groups.tp_group,
                                       temperature=self.temperature)

    def token_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """[b, L, V_local] (or [b, L, 3]) -> [b, L-1] entropy of the full-vocab distribution at the sampling
        temperature."""
        if self.chunked:
            return logits[:, :-1, 1]
        return vocab_parallel_entropy(logits[:, :-1], vocab_start=self._vocab_start(),
                                      vocab_size=self.spec.vocab_size, group=self.groups.tp_group,
                                      temperature=self.temperature)

    def token_top1(self, logits: torch.Tensor) -> torch.Tensor:
        """[b, L, V_local] (or [b, L, 3]) -> [b, L-1] the most likely next token, int64."""
        if self.chunked:
            return logits[:, :-1, 2].long()
        return vocab_parallel_top1(logits[:, :-1], vocab_start=self._vocab_start(), vocab_size=self.spec.vocab_size,
                                   group=self.groups.tp_group)

    def _preparing(self, routing: Sequence[np.ndarray] | None, counting: bool
                   ) -> Callable[[torch.nn.Module, MicroBatch], None] | None:
        """What runs before each chunk's forward of a micro-batch: the chunked head takes its tokens, and the
        routers its sequences' routing (``_replaying``)."""
        replaying = self._replaying(routing, counting)
        if not self.chunked:
            return replaying
        thd = self.packing == "thd"

        def prepare(model: torch.nn.Module, batch: MicroBatch) -> None:
            if replaying is not None:
                replaying(model, batch)
            logprob_head.aim(model, batch.tokens.to(self.groups.device), thd)

        return prepare

    def _replaying(self, routing: Sequence[np.ndarray] | None, counting: bool
                   ) -> Callable[[torch.nn.Module, MicroBatch], None] | None:
        """The routers take a micro-batch's sequences' routing (``counting``: and count where they would have chosen
        otherwise)."""
        if routing is None:
            assert self.replay is None, "this model replays routing: pass every sequence's"
            return None
        assert self.replay is not None, "routing given to a model built without routing_replay"
        replay, spec = self.replay, self.spec
        replay.clear()
        placed: dict[int, torch.Tensor] = {}

        def prepare(model: torch.nn.Module, batch: MicroBatch) -> None:
            if id(batch) not in placed:
                placed[id(batch)] = place_routing(batch, routing, spec.num_layers, spec.num_experts_per_tok)
            replay.set(model, placed[id(batch)], self.groups.device, counting)

        return prepare

    def routing_disagreement(self) -> dict[str, float]:
        """Share of the replayed expert choices (token x layer, all ranks) that this model's routers would have
        made differently in its scoring passes since the last call: the mismatch routing replay corrects."""
        if self.replay is None:
            return {}
        counts = torch.tensor(self.replay.disagreement(), dtype=torch.float64, device=self.groups.device)
        dist.all_reduce(counts)
        return {"routing/disagreement": float(counts[1] / counts[0]) if counts[0] else 0.0}

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], max_tokens: int | None, micro_batch_size: int = 1,
              routing: Sequence[np.ndarray] | None = None, top1: bool = False) -> list[torch.Tensor] | None:
        """Per-sequence [len-1] logprobs (policy/reference) or [len-1] values (critic), last stage only; with
        ``top1``, [len-1, 2]: the logprobs and the most likely token at each position (as a float).

        Values are those of the positions that predict tokens 1..len-1, aligned like logprobs. ``routing``:
        each sequence's [len-1, num_layers, k] expert choices, with routing replay.
        """
        batches = self._micro_batches(sequences, max_tokens, micro_batch_size)
        prepare = self._preparing(routing, counting=True)

        def keep(tokens: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
            if self.opts.critic:
                return output[:, :-1, 0].float()
            logprobs = self.token_logprobs(output, tokens)
            if top1:
                return torch.stack([logprobs.float(), self.token_top1(output).float()], dim=-1)
            return logprobs

        outputs = forward_only(self.chunks, self.groups, batches, keep, prepare, thd=self.packing == "thd")
        if self.replay is not None:
            self.replay.clear()
        if outputs is None:
            return None
        rows: dict[int, torch.Tensor] = {}
        for batch, out in zip(batches, outputs, strict=True):
            rows |= batch.take(out)
        return [rows[i] for i in range(len(sequences))]

    def skip_step(self) -> None:
        """An optimizer step not taken (a mini-batch with no token in the loss): the LR schedule moves past it."""
        self.scheduler.step(increment=1)

    def train_step(self, sequences: Sequence[Sequence[int]], extras: dict[str, list[torch.Tensor]],
                   loss_fn: LossFn, max_tokens: int | None, micro_batch_size: int = 1, where: str = "train step",
                   routing: Sequence[np.ndarray] | None = None) -> dict[str, float]:
        """One optimizer step over ``sequences`` (this DP rank's share).

        A non-finite loss stops training before the optimizer step, a non-finite grad norm right after
        it (TrainingDiverged, naming ``where``); every rank sees the same reduced values and stops together.

        ``extras`` holds per-sequence [len-1] tensors (advantages, old logprobs, weights, ...);
        ``loss_fn`` returns the micro-batch's *weighted sum*, already normalised for the global
        batch (see algos.losses.token_weights), so micro-batches and DP ranks simply add up.
        ``routing`` as for ``score``.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = self._micro_batches(sequences, max_tokens, micro_batch_size)
        prepare = self._preparing(routing, counting=False)
        # Padding and the position where one packed sequence "predicts" the next get 0 extras: weight 0.
        extra_batches = [{name: b.place(rows) for name, rows in extras.items()} for b in batches]
        device = self.groups.device
        thd = self.packing == "thd"
        num_mb = len(batches)
        dp = self.groups.dims.dp
        # the router's load-balancing loss counts the tokens it is told are not padding
        aux_loss, sp_shard = self.opts.moe_aux_loss_coeff > 0, self.opts.sequence_parallel

        def data() -> Iterator[tuple[MicroBatch, dict[str, torch.Tensor]]]:
            yield from zip(batches, extra_batches, strict=True)

        def forward_step(it: Iterator, model: torch.nn.Module) -> Any:
            batch, part = next(it)
            if prepare is not None:
                prepare(model, batch)
            tokens, inputs = model_inputs(batch, device, thd, padding=aux_loss)
            if aux_loss and sp_shard and not unwrap(model).pre_process:
                # GPTModel splits the mask along the sequence for sequence parallelism on the first stage only
                inputs["padding_mask"] = inputs["padding_mask"].chunk(self.groups.dims.tp, dim=1)[
                    self.groups.tp_rank].contiguous()
            part = {k: v.to(device) for k, v in part.items()}
            output = model(**inputs)

            def loss(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                value, metrics = loss_fn(output_rows(out, tokens), tokens, part)
                # Megatron divides by the micro-batch count and DDP averages over DP; undo both so
                # that the weighted sums add up to the global-batch loss.
                return value * num_mb * dp, {"loss": value.detach().clone(), **metrics}

            return output, loss

        for m in self.models:
            m.zero_grad_buffer()  # type: ignore[operator]
        self.optimizer.zero_grad()
        multi = len(self.models) > 1
        length, rows = schedule_shape(batches, thd)
        with self.adapters.dropout() if self.adapters is not None else nullcontext():  # actor.lora.dropout
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=[data() for _ in self.models] if multi else data(),
                model=self.models if multi else self.models[0], num_microbatches=num_mb, seq_length=length,
                micro_batch_size=rows, forward_only=False)
        if self.replay is not None:
            self.replay.clear()
        metrics = _sum_metrics(outputs, self.groups)
        check_finite(where, metrics, "The loss is not finite: its inputs (log-probabilities, advantages, values) "
                     "or the model's outputs overflowed.")
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step trains at
        ok, grad_norm, _ = self.optimizer.step()
        # float16's loss scaler skips a step with inf/NaN gradients itself (ok False, no norm): that is routine.
        check_finite(where, {"grad_norm": float(grad_norm) if ok and grad_norm is not None else 0.0},
                     "The gradients are not finite although the loss is: lower the learning rate or use "
                     "bfloat16, and check the model's weights.")
        if ok:  # a step the loss scaler skipped did not happen: the schedule waits for it (as Megatron's loop does)
            self.scheduler.step(increment=1)
        metrics |= {"grad_norm": float(grad_norm or 0.0), "lr": lr,
                    "update_skipped": float(not ok), "padding_fraction": _padding_fraction(batches, self.groups)}
        return metrics


def _padding_fraction(batches: list[MicroBatch], groups: ParallelGroups) -> float:
    """Share of the token slots this step ran that held padding, over all data-parallel ranks."""
    counts = torch.tensor([sum(b.num_tokens() for b in batches), sum(b.tokens.numel() for b in batches)],
                          dtype=torch.float64, device=groups.device)
    dist.all_reduce(counts, group=groups.dp_group)
    return float(1 - counts[0] / counts[1])


def _sum_metrics(outputs: list[dict[str, torch.Tensor]], groups: ParallelGroups) -> dict[str, float]:
    """Sum the micro-batch metrics (weighted sums) on the last stage, then share them with every rank."""
    keys = sorted(outputs[0]) if outputs else []
    names = [keys]
    dist.broadcast_object_list(names, src=dist.get_global_rank(groups.pp_group, groups.dims.pp - 1),
                               group=groups.pp_group)
    keys = names[0]
    values = torch.zeros(len(keys), dtype=torch.float64, device=groups.device)
    for out in outputs:
        values += torch.tensor([float(out[k]) for k in keys], dtype=torch.float64, device=groups.device)
    dist.all_reduce(values, group=groups.pp_group)
    dist.all_reduce(values, group=groups.dp_group)
    return dict(zip(keys, values.tolist(), strict=True))


def _optimizer(models: list[torch.nn.Module], optim: OptimizerConfig, dtype: torch.dtype) -> Any:
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    config = MegatronOptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, use_distributed_optimizer=optim.use_distributed_optimizer,
        # float16's dynamic loss scale starts at 2^16 (torch's GradScaler default), not Megatron's 2^32,
        # which overflows and skips the first dozens of steps while it backs off: most of a short RL run.
        initial_loss_scale=2.0**16)
    return get_megatron_optimizer(config, models)


def lr_scheduler(optimizer: Any, optim: OptimizerConfig, num_steps: int, updates_per_step: int) -> Any:
    """Megatron's scheduler for ``optimizer``, stepped once per optimizer step: warm-up over
    ``optim.num_warmup_steps`` RL steps, decay to ``optim.min_lr`` over all ``num_steps`` RL steps, each
    ``updates_per_step`` optimizer steps long (sized in RL steps, the decay would end a factor
    ``updates_per_step`` early). A checkpoint restores how far the schedule has come, never its shape: the
    config's holds, also for checkpoints written while it was sized in RL steps."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup, total = optim.num_warmup_steps * updates_per_step, num_steps * updates_per_step
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(total, warmup + 1), lr_decay_style=optim.lr_schedule,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=max(total, 1),
        wd_incr_style="constant", override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
