"""Worker for test_checkpoint.py: save the actor after an update in TP1 x PP1 (DP4), load it in TP2 x PP2.

The loaded model's logprobs must equal the saved model's, and differ from the HF weights it started from.
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402

from megarl import checkpoint  # noqa: E402
from megarl.config import OptimizerConfig  # noqa: E402
from megarl.models.gpt import BuildOptions  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402
from megarl.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)

SEQS = [[1, 5, 7, 9, 100, 150, 3], [2, 8, 199, 4, 6]]


def logprobs(model):
    out = model.score(SEQS, 64)
    return None if out is None else torch.cat(out)


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    init_distributed(platform)
    spec = load_spec(model_dir)
    optim = OptimizerConfig(lr=1e-2)
    groups = init_model_parallel(ParallelDims(tp=1, pp=1, dp=4))
    model_parallel_seed(0)
    actor = MegatronModel(spec, model_dir, groups, BuildOptions(), optim)
    initial = logprobs(actor)

    def loss(logits, tokens, ex):
        return (actor.token_logprobs(logits, tokens) * ex["w"]).sum(), {}

    actor.train_step(SEQS, {"w": [torch.ones(len(s) - 1) for s in SEQS]}, loss, 64)
    saved = logprobs(actor)
    path = checkpoint.save(str(out_dir / "ckpt"), 0, {"actor": actor}, {"step": 0}, keep_last=1)
    destroy_model_parallel()

    groups = init_model_parallel(ParallelDims(tp=2, pp=2, dp=1))
    model_parallel_seed(0)
    other = MegatronModel(spec, model_dir, groups, BuildOptions(), optim)
    checkpoint.load(path, {"actor": other})
    loaded = logprobs(other)
    if loaded is not None and groups.tp_rank == 0:
        result = {"max_diff": (loaded - saved).abs().max().item(), "changed": (saved - initial).abs().max().item()}
        (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
