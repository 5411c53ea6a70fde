"""Multi-rank worker for test_trainable.py: one GRPO actor update in several TP/PP/DP layouts,
with sequences packed into shared rows and without (one padded row each).

torchrun --nproc-per-node 4 tests/workers/trainable.py OUT_DIR MODEL_DIR [TEACHER_DIR]
The same batch, advantages and global token weights in every layout; each layout reports the
logprobs before the update, the summed loss, grad norm, padding fraction and the updated model's
logprobs, which must match the single-replica run and, packed, the unpacked one. With TEACHER_DIR, each layout's
packed run also scores the batch with that model, frozen (a distillation teacher of another shape).
"""

import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402

from megarl.algos.losses import token_weights  # noqa: E402
from megarl.config import AlgorithmConfig, OptimizerConfig  # noqa: E402
from megarl.data.batching import plan_micro_batches  # noqa: E402
from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.errors import TrainingDiverged  # noqa: E402
from megarl.loop.rl_step import Batch, actor_loss  # noqa: E402
from megarl.memory.offload import PARTS, ModelResidency  # noqa: E402
from megarl.models import trainable  # noqa: E402
from megarl.models.gpt import BuildOptions  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MODES = ("packed", "unpacked", "fixed")


def unpacked(*args, **kwargs):
    return plan_micro_batches(*args, **kwargs | {"pack": False})


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    teacher_dir = sys.argv[3] if len(sys.argv) > 3 else None
    init_distributed(platform)
    world = dist.get_world_size()
    spec = load_spec(model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (3, 5, 4, 2, 6, 3, 4, 14)]
    responses = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (4, 2, 6, 3, 1, 5, 2, 6)]
    rollout_lp = [[-1.0] * len(r) for r in responses]
    scores = torch.rand(len(prompts), generator=gen).tolist()
    batch = Batch.build(prompts, responses, rollout_lp, scores)
    # An entropy bonus at a sampling temperature: its vocab-parallel gradient must not grow with TP.
    algo = AlgorithmConfig(name="grpo", clip_ratio_low=0.2, clip_ratio_high=0.28,
                           loss_aggregation="seq-mean-token-mean", entropy_coef=0.5)
    advantages = torch.randn(batch.mask.shape, generator=gen) * batch.mask
    weights = token_weights(batch.mask, algo.loss_aggregation)
    results = []
    runs = [(layout, mode) for layout in LAYOUTS for mode in MODES]
    # Sequence parallelism (packed rows, odd lengths): rows must be padded to a multiple of TP.
    runs += [((2, 1), "sp"), ((2, 2), "sp")]
    # Megatron's packed format (Transformer Engine's): every micro-batch's rows end to end, RoPE from 0 per sequence.
    runs += [(layout, "thd") for layout in LAYOUTS] + [((2, 2), "thd_sp")]
    # 16-bit training: float16 must scale the loss (Megatron's grad scaler unscales the gradients), or its
    # update comes out ~2^-32 of bfloat16's.
    runs += [((2, 1), "bfloat16"), ((2, 1), "float16"), ((1, 2), "nan"), ((2, 1), "twice"), ((2, 1), "offload")]
    # The interleaved schedule runs micro-batches in groups of PP: scoring 8 sequences in 3 micro-batches must not
    # stop it (empty ones make up a multiple of PP).
    runs += [((1, 2), "vpp")]
    for (tp, pp), mode in runs:
        # Token budgets for scoring and training, or None: fixed micro-batches of 2 (dynamic_batch: false).
        score_budget, train_budget = (64, 40) if mode != "fixed" else (None, None)
        dims = ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp), vpp=2 if mode == "vpp" else None)
        groups = init_model_parallel(dims)
        model_parallel_seed(0)
        with contextlib.nullcontext() if mode != "unpacked" else mock.patch.object(trainable, "plan_micro_batches",
                                                                                   unpacked):
            dtype = getattr(torch, mode) if mode in ("bfloat16", "float16") else torch.float32
            opts = BuildOptions(sequence_parallel=mode in ("sp", "thd_sp"), dtype=dtype,
                                packing="thd" if mode.startswith("thd") else "auto")
            actor = MegatronModel(spec, model_dir, groups, opts,
                                  OptimizerConfig(lr=1e-2, clip_grad=0.0, use_distributed_optimizer=True), num_steps=2,
                                  temperature=0.8)
            before = actor.score(batch.sequences, score_budget, 2)
            old = batch.stack(dict(enumerate(before or [torch.zeros(len(s) - 1) for s in batch.sequences])))
            if pp > 1:
                dist.broadcast(old, src=dist.get_global_rank(groups.pp_group, pp - 1), group=groups.pp_group)
            # A shifted "old" policy makes the ratios differ from 1, so clipping is exercised.
            extras = {"old_logprobs": old - 0.5 * advantages, "advantages": advantages, "weights": weights}
            mine = list(range(groups.dp_rank, len(batch.sequences), dims.dp))
            rows = {k: [batch.rows(v)[i] for i in mine] for k, v in extras.items()}

            def loss(logits, tokens, ex, a=actor):
                return actor_loss(a.token_logprobs(logits, tokens), ex, algo, 0.0, a.token_entropy(logits))

            if mode == "nan":  # a NaN advantage: every rank must stop before the optimizer step, together
                rows["advantages"][0] = torch.full_like(rows["advantages"][0], float("nan"))
                try:
                    actor.train_step([batch.sequences[i] for i in mine], rows, loss, train_budget, 2,
                                     where="step 5, actor")
                    error = ""
                except TrainingDiverged as err:
                    error = str(err)
                results.append({"tp": tp, "pp": pp, "mode": mode, "rank": dist.get_rank(), "error": error,
                                "weights_finite": all(bool(p.isfinite().all()) for p in actor.named_params().values())})
                destroy_model_parallel()
                continue
            metrics = actor.train_step([batch.sequences[i] for i in mine], rows, loss, train_budget, 2)
            if mode in ("twice", "offload"):  # a second step, after all state left the device and came back
                if mode == "offload":
                    residency = ModelResidency(actor)
                    freed = residency.offload(PARTS)
                    assert freed > 0 and all(residency.device_bytes(p) == 0 for p in PARTS), freed
                    grads = sum(b.grad_data.nbytes for m in actor.models for b in m.buffers)
                    assert residency.onload(PARTS) == freed - grads  # gradients come back as zeros, not copied
                metrics = actor.train_step([batch.sequences[i] for i in mine], rows, loss, train_budget, 2)
            after = actor.score(batch.sequences, score_budget, 2)
            taught = None
            if teacher_dir and mode == "packed":  # a distillation teacher of another shape, frozen beside the actor
                teacher = MegatronModel(load_spec(teacher_dir), teacher_dir, groups, opts, temperature=0.8)
                taught = teacher.score(batch.sequences, score_budget, 2)
        if taught is not None and groups.tp_rank == 0 and groups.dp_rank == 0:
            results.append({"tp": tp, "pp": pp, "mode": "teacher", "sequences": batch.sequences,
                            "logprobs": torch.cat(taught).tolist()})
        if after is not None and groups.tp_rank == 0 and groups.dp_rank == 0:
            results.append({"tp": tp, "pp": pp, "dp": dims.dp, "mode": mode, "loss": metrics["loss"],
                            "grad_norm": metrics["grad_norm"],
                            "entropy": metrics["entropy_sum"] / metrics["num_tokens"],  # per token, as mean_metrics
                            "update_skipped": metrics["update_skipped"],
                            "clip_fraction": metrics["clipped_tokens"] / metrics["num_tokens"],
                            "padding_fraction": metrics["padding_fraction"],
                            "logprobs_before": torch.cat(before).tolist(), "logprobs_after": torch.cat(after).tolist()})
        destroy_model_parallel()
    if results:
        (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
