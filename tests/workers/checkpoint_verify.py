"""Each rank looks for a checkpoint to resume (checkpoint.find), explicitly and with `auto`; rank*.json: what it
got (the error paragraph, or the path). argv: OUT_DIR CHECKPOINT_DIR DAMAGED_CHECKPOINT."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from megarl import checkpoint
from megarl.errors import UserError

out, directory, damaged = sys.argv[1:4]
dist.init_process_group("gloo")
row = {}
try:
    row["explicit"] = str(checkpoint.find(damaged, directory))
except UserError as err:
    row["explicit"] = f"UserError: {err}"
row["auto"] = str(checkpoint.find("auto", directory))
Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(row))
dist.destroy_process_group()
