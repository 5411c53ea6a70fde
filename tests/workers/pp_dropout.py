"""torchrun worker for test_lora_training.py: the dropout masks each pipeline stage draws after model_parallel_seed.

python tests/workers/pp_dropout.py OUT_DIR PP
Writes rank<R>.json: the masks of the default RNG (column layers' dropout) and of megatron's tracker (row layers').
"""

import json
import sys

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.nn.functional as F  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: E402

from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
    shutdown_distributed,
)

out, pp = sys.argv[1], int(sys.argv[2])
init_distributed(platform)
init_model_parallel(ParallelDims(tp=1, pp=pp, dp=1))
model_parallel_seed(1)
ones = torch.ones(256)
default = (F.dropout(ones, 0.5, training=True) > 0).tolist()
with get_cuda_rng_tracker().fork():
    tracked = (F.dropout(ones, 0.5, training=True) > 0).tolist()
rank = ps.get_pipeline_model_parallel_rank()
with open(f"{out}/rank{rank}_pp{pp}.json", "w") as f:
    json.dump({"stage": rank, "pp": pp, "default": default, "tracked": tracked}, f)
shutdown_distributed()
