"""`python megarl/train.py` without torchrun runs as a world of one whose store lives in its own memory: a port
picked free and bound later by a TCP store was taken in between by another process on a busy host (EADDRINUSE, a
crash at start, seen in CI)."""

import os
import subprocess
import sys

from helpers import REPO

WORLD_OF_ONE = """
import os, torch, torch.distributed as dist
from megarl.loop.bootstrap import standalone_env
from megarl.platform import init_platform
from megarl.distributed.parallel import init_distributed

standalone_env()
init_distributed(init_platform())
total = torch.ones(3)
dist.all_reduce(total, group=dist.new_group([0]))
assert total.tolist() == [1.0, 1.0, 1.0]
store = dist.distributed_c10d._get_default_store()._underlying_non_prefix_store
print("STORE", type(store).__name__, os.environ.get("MASTER_PORT"))
"""


def test_a_world_of_one_meets_in_its_own_memory_on_no_port():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", WORLD_OF_ONE], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                                  "MASTER_PORT": "29500"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STORE HashStore None" in proc.stdout, proc.stdout
