"""Worker for test_moe_aux_loss.py: an MoE router's load-balancing loss does not count padding.

torchrun --nproc-per-node 4 tests/workers/moe_aux_padding.py OUT_DIR QWEN3_MOE_DIR
The same two sequences, all advantages 0 (the policy loss gives no gradient, the aux loss alone does), in one
micro-batch of two rows and in one of four rows (two of them padding), under TP2 x PP2 with sequence parallelism:
the second stage's padding mask is its own shard. Rank 0 writes rank0.json: {micro_batch_size: grad_norm}.
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
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.loop.rl_step import Batch, actor_loss  # noqa: E402
from megarl.models.gpt import BuildOptions  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    init_distributed(platform)
    groups = init_model_parallel(ParallelDims(tp=2, pp=2, dp=1))
    spec = load_spec(model_dir)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, spec.vocab_size, (8,), generator=gen).tolist() for _ in range(2)]
    batch = Batch.build([s[:2] for s in seqs], [s[2:] for s in seqs], [[-1.0] * 6 for _ in seqs], [1.0, 0.0])
    extras = {"old_logprobs": torch.zeros_like(batch.mask), "advantages": torch.zeros_like(batch.mask),
              "weights": token_weights(batch.mask, "token-mean")}
    rows = {k: batch.rows(v) for k, v in extras.items()}
    algo, norms = AlgorithmConfig(name="grpo"), {}
    for micro_batch_size in (2, 4):
        model_parallel_seed(0)
        actor = MegatronModel(spec, model_dir, groups,
                              BuildOptions(dtype=torch.float32, moe_aux_loss_coeff=0.1, sequence_parallel=True),
                              OptimizerConfig(lr=1e-9, clip_grad=0.0, use_distributed_optimizer=False), num_steps=1)

        def loss(out, tokens, ex, actor=actor):
            return actor_loss(actor.token_logprobs(out, tokens), ex, algo, 0.0)

        metrics = actor.train_step(batch.sequences, rows, loss, None, micro_batch_size)
        norms[micro_batch_size] = {"grad_norm": metrics["grad_norm"], "padding": metrics["padding_fraction"]}
    if dist.get_rank() == 0:
        (out_dir / "rank0.json").write_text(json.dumps(norms))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
