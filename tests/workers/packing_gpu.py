"""Worker for test_packing_gpu.py: the actor's scoring and one update on one GPU in bf16, rows packed and with one
padded sequence per row, on Transformer Engine's layers (PACKING_TE=1: packed rows in THD format) or the local
spec's (FlexAttention over segment ids).

torchrun --nproc-per-node 1 tests/workers/packing_gpu.py OUT_DIR MODEL_DIR
Writes OUT_DIR/rank0.json: per mode the layer classes, packing, padding share, logprobs before and after the
update, loss and grad norm.
"""

import json
import os
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402

from megarl.config import OptimizerConfig  # noqa: E402
from megarl.distributed.parallel import ParallelDims, init_distributed, init_model_parallel, model_parallel_seed  # noqa: E402
from megarl.models.gpt import BuildOptions, layer_implementation  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402

TE = os.environ.get("PACKING_TE") == "1"


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    init_distributed(platform)
    spec = load_spec(model_dir)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (24,), generator=gen).tolist()
    sequences = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    weights = [torch.full((n - 1,), 1.0 / sum(lengths)) for n in lengths]
    results = {}
    groups = init_model_parallel(ParallelDims(tp=1, pp=1, dp=1))
    for mode in ("off", "auto"):
        model_parallel_seed(0)
        opts = BuildOptions(dtype=torch.bfloat16, transformer_engine=TE, packing=mode)
        actor = MegatronModel(spec, model_dir, groups, opts, OptimizerConfig(lr=1e-3, clip_grad=0.0))

        def loss(logits, tokens, extras, a=actor):
            return -(a.token_logprobs(logits, tokens) * extras["weights"]).sum(), {}

        before = actor.score(sequences, 128)
        metrics = actor.train_step(sequences, {"weights": weights}, loss, 96)
        after = actor.score(sequences, 128)
        assert before is not None and after is not None
        results[mode] = {"layers": layer_implementation(actor.chunks), "packing": actor.packing,
                         "padding_fraction": metrics["padding_fraction"], "loss": metrics["loss"],
                         "grad_norm": metrics["grad_norm"], "logprobs_before": torch.cat(before).tolist(),
                         "logprobs_after": torch.cat(after).tolist()}
        del actor
    (out_dir / "rank0.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
