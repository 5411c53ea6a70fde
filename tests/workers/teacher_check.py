"""Worker for test_distill.py: a resume's check of the distillation teacher on two ranks.

torchrun --nproc-per-node 2 tests/workers/teacher_check.py OUT_DIR CHECKPOINT TEACHER
Each rank runs check_unchanged on CHECKPOINT (whose trainer.json records another teacher's files) with
distill.teacher = TEACHER, counting its reads of the teacher's files. Rank r writes rankR.json:
{"rank": r, "reads": ..., "refused": "the error's message" or null}.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from megarl.checkpoint import manifest
from megarl.checkpoint.resume_check import check_unchanged
from megarl.config import load_config
from megarl.errors import UserError

out, step, teacher = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
reads = 0
files_differ = manifest.files_differ


def counted(files, hf_dir):
    global reads
    reads += 1
    return files_differ(files, hf_dir)


manifest.files_differ = counted
cfg = load_config(Path("recipes/tiny_cpu_grpo.yaml"), [f"checkpoint.dir={step.parent}", f"distill.teacher={teacher}"])
refused = None
try:
    check_unchanged(cfg, step, rank)
except UserError as err:
    refused = str(err)
(out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "reads": reads, "refused": refused}))
dist.destroy_process_group()
