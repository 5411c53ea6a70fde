"""Multi-rank worker for test_chunked_logprobs_megatron.py: the chunked log-probability head against Megatron's
full logits, in one launch over several layouts.

torchrun --nproc-per-node 2 tests/workers/chunked_logprobs.py OUT_DIR LLAMA_DIR QWEN2_DIR QWEN3_MOE_DIR
For each layout an actor with ``logprob_chunk_tokens`` 5 (chunks that divide no micro-batch here) and one with 0
(full logits) score the same batch at T = 0.8 and take one GRPO update with an entropy bonus; rank 0 of each
layout's last stage writes the logprobs before and after, the loss, the entropy and the grad norm of both.
Llama has its own output weight; Qwen2 ties it to the embedding (with PP2 the last stage's copy); Qwen3-MoE replays
given expert choices (routing replay) under TP2 with sequence parallelism.
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402

from megarl.algos.losses import token_weights  # noqa: E402
from megarl.config import AlgorithmConfig, OptimizerConfig  # noqa: E402
from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.loop.rl_step import Batch, actor_loss  # noqa: E402
from megarl.models.gpt import BuildOptions, unwrap  # noqa: E402
from megarl.models.routing import routing_dtype  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402

# (model, TP, PP, mode): "sp" = sequence parallelism, "thd" = packed rows in Megatron's THD format, "vpp" = two
# virtual stages per PP rank (the head on the last one), "replay" = routing replay.
RUNS = [("llama", 1, 1, "plain"), ("llama", 2, 1, "sp"), ("llama", 1, 1, "thd"), ("llama", 2, 1, "thd_sp"),
        ("llama", 1, 2, "vpp"),
        ("qwen2", 1, 1, "plain"), ("qwen2", 1, 2, "plain"), ("qwen2", 2, 1, "sp"), ("qwen3_moe", 2, 1, "sp_replay")]
CHUNK = 5


def main() -> None:
    out_dir, models = Path(sys.argv[1]), {"llama": sys.argv[2], "qwen2": sys.argv[3], "qwen3_moe": sys.argv[4]}
    init_distributed(platform)
    world = dist.get_world_size()
    algo = AlgorithmConfig(name="grpo", clip_ratio_low=0.2, clip_ratio_high=0.28,
                           loss_aggregation="seq-mean-token-mean", entropy_coef=0.5)
    results = []
    for name, tp, pp, mode in RUNS:
        spec = load_spec(models[name])
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (3, 5, 4, 2, 6, 3)]
        responses = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (4, 2, 6, 3, 1, 9)]
        replay = mode.endswith("replay")
        routing = [(torch.rand(len(p) + len(r) - 1, spec.num_layers, spec.num_experts, generator=gen)
                    .argsort(-1)[..., :spec.num_experts_per_tok].numpy().astype(routing_dtype(spec.num_experts)))
                   for p, r in zip(prompts, responses, strict=True)] if replay else None
        batch = Batch.build(prompts, responses, [[-1.0] * len(r) for r in responses], [0.0] * len(prompts), routing)
        advantages = torch.randn(batch.mask.shape, generator=gen) * batch.mask
        weights = token_weights(batch.mask, algo.loss_aggregation)
        row: dict = {"model": name, "tp": tp, "pp": pp, "mode": mode}
        for chunk in (CHUNK, 0):
            groups = init_model_parallel(ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp),
                                                      vpp=2 if mode == "vpp" else None))
            model_parallel_seed(0)
            opts = BuildOptions(sequence_parallel="sp" in mode, packing="thd" if "thd" in mode else "auto",
                                logprob_chunk_tokens=chunk)
            actor = MegatronModel(spec, models[name], groups, opts, OptimizerConfig(lr=1e-2, clip_grad=0.0), 1,
                                  temperature=0.8, routing_replay=replay)
            heads = [getattr(unwrap(c), "output_layer", None) for c in actor.chunks]
            chunked = any(hasattr(h, "logprob_head") for h in heads)
            before = actor.score(batch.sequences, 40, 2, routing=routing)
            old = batch.stack(dict(enumerate(before or [torch.zeros(len(s) - 1) for s in batch.sequences])))
            if pp > 1:
                dist.broadcast(old, src=dist.get_global_rank(groups.pp_group, pp - 1), group=groups.pp_group)
            extras = {"old_logprobs": old - 0.5 * advantages, "advantages": advantages, "weights": weights}
            mine = list(range(groups.dp_rank, len(batch.sequences), groups.dims.dp))
            rows = {k: [batch.rows(v)[i] for i in mine] for k, v in extras.items()}

            def loss(out, tokens, ex, a=actor):
                return actor_loss(a.token_logprobs(out, tokens), ex, algo, 0.0, a.token_entropy(out))

            metrics = actor.train_step([batch.sequences[i] for i in mine], rows, loss, 24, 2,
                                       routing=[routing[i] for i in mine] if routing else None)
            after = actor.score(batch.sequences, 40, 2, routing=routing)
            key = "chunked" if chunk else "full"
            row[key] = {"head": chunked, "loss": metrics["loss"],
                        "entropy": metrics["entropy_sum"] / metrics["num_tokens"],  # per token, as mean_metrics
                        "grad_norm": metrics["grad_norm"],
                        "before": torch.cat(before).tolist() if before else None,
                        "after": torch.cat(after).tolist() if after else None}
            last = groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0
            destroy_model_parallel()
        if last:
            results.append(row)
    if results:
        (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
