"""Worker for test_lr_schedule.py: a float16 actor on one rank takes RL steps of several optimizer steps under
a warm-up + cosine schedule, one of them with gradients that overflow float16 (the loss scaler skips it).

torchrun --nproc-per-node 1 tests/workers/lr_schedule.py OUT_DIR MODEL_DIR NUM_STEPS UPDATES_PER_STEP SKIPPED
Writes rank0.json: each optimizer step's lr and update_skipped, in order.
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

from megarl.algos.losses import token_weights  # noqa: E402
from megarl.config import AlgorithmConfig, OptimizerConfig  # noqa: E402
from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
    shutdown_distributed,
)
from megarl.loop.rl_step import Batch, actor_loss  # noqa: E402
from megarl.models.gpt import BuildOptions  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    num_steps, updates, skipped = (int(a) for a in sys.argv[3:6])
    init_distributed(platform)
    groups = init_model_parallel(ParallelDims(tp=1, pp=1, dp=1))
    model_parallel_seed(0)
    spec = load_spec(model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (3, 5, 4, 2)]
    responses = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (4, 2, 6, 3)]
    batch = Batch.build(prompts, responses, [[-1.0] * len(r) for r in responses], [0.0] * 4)
    optim = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_schedule="cosine", num_warmup_steps=1)
    actor = MegatronModel(spec, model_dir, groups, BuildOptions(dtype=torch.float16), optim, num_steps,
                          updates_per_step=updates)
    algo = AlgorithmConfig(name="grpo")
    old = batch.stack(dict(enumerate(actor.score(batch.sequences, 256) or [])))
    weights = token_weights(batch.mask, "token-mean")

    def loss(logits: torch.Tensor, tokens: torch.Tensor, ex: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
        return actor_loss(actor.token_logprobs(logits, tokens), ex, algo, 0.0)

    rows = []
    for k in range(num_steps * updates):
        # Advantages of 1e4 leave the loss finite, but its gradients times the loss scale (2^16) overflow float16.
        scale = 1e4 if k == skipped else 0.1
        advantages = torch.randn(batch.mask.shape, generator=gen) * batch.mask * scale
        extras = {"old_logprobs": old, "advantages": advantages, "weights": weights}
        metrics = actor.train_step(batch.sequences, {n: batch.rows(v) for n, v in extras.items()}, loss, 256)
        rows.append({"lr": metrics["lr"], "update_skipped": metrics["update_skipped"]})
    (out_dir / "rank0.json").write_text(json.dumps(rows))
    shutdown_distributed()  # gloo's threads left to C++ static destructors can abort the exit


if __name__ == "__main__":
    main()
