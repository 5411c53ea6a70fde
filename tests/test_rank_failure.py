"""A run of several ranks that one rank ends: that rank's error is the one paragraph the user reads, and every other
rank, whose next collective fails for want of it, says so in one line instead of a traceback that would bury it."""

import os
import re
import subprocess
import sys

from helpers import REPO, free_port

WORKER = """
import os, torch, torch.distributed as dist
from megarl.errors import UserError
from megarl.run.command import run_main

def main():
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 0:
        raise UserError("data.train_path = 'x.jsonl': line 3 is not JSON. Fix: mend or remove that line.")
    dist.all_reduce(torch.ones(1))  # rank 0 is gone: gloo finds its connection closed

run_main(main)
"""


def test_the_ranks_that_lose_a_failed_rank_say_so_in_one_line_under_its_error(tmp_path):
    """The ranks are started here, not by torchrun, whose agent would kill the others once rank 0 ends."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = os.environ | {"PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "WORLD_SIZE": "3", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py")], cwd=REPO, env=env | {"RANK": str(r)},
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    # Rank 0 ends with its own error's code however fast the others close their connections (gloo's destructor
    # would abort it, SIGABRT, under a sys.exit).
    assert [p.returncode for p in procs] == [2, 1, 1], errs
    assert errs[0] == "megarl error: data.train_path = 'x.jsonl': line 3 is not JSON. Fix: mend or remove that line.\n"
    for rank in (1, 2):
        assert re.fullmatch(rf"megarl: rank {rank} stopped: another rank closed its connection, most likely because "
                            r"it ended first with the error above \(MEGARL_DEBUG=1 shows this rank's traceback\)\. "
                            r".*Connection (closed|reset) by peer.*\n", errs[rank]), errs[rank]


def test_one_process_keeps_its_traceback_for_the_same_error(tmp_path):
    (tmp_path / "one.py").write_text("from megarl.run.command import run_main\n"
                                     "def main():\n    raise RuntimeError('Connection closed by peer [x]:1')\n"
                                     "run_main(main)\n")
    proc = subprocess.run([sys.executable, str(tmp_path / "one.py")], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "megarl: rank" not in proc.stderr


ONE_RANK = """
import torch, torch.distributed as dist
from megarl.errors import UserError, raised_alike
from megarl.run.command import run_main

def main():
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    with raised_alike():  # every rank refuses the same file: rank 0 alone says so
        if {alike}:
            raise UserError("checkpoint x: damaged. Fix: resume another.")
    if dist.get_rank() == 1:  # this rank's own shard
        raise UserError("checkpoint x: rank 1's shard is truncated. Fix: resume another.")
    dist.all_reduce(torch.ones(1))

run_main(main)
"""


def _three_ranks(tmp_path, alike: bool) -> tuple[list[int], list[str]]:
    (tmp_path / "worker.py").write_text(ONE_RANK.replace("{alike}", str(alike)))
    env = os.environ | {"PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "WORLD_SIZE": "3", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py")], cwd=REPO, env=env | {"RANK": str(r)},
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    return [p.returncode for p in procs], errs


def test_an_error_of_one_rank_other_than_rank_0_is_reported_by_it(tmp_path):
    """It was left to rank 0, which had none: the run ended on the other ranks' "with the error above", and none."""
    codes, errs = _three_ranks(tmp_path, alike=False)
    assert codes[1] == 2, errs
    assert errs[1] == "megarl error (rank 1): checkpoint x: rank 1's shard is truncated. Fix: resume another.\n"
    assert all("megarl error" not in errs[r] and "another rank closed its connection" in errs[r] for r in (0, 2)), errs


def test_an_error_every_rank_raises_alike_is_reported_once(tmp_path):
    codes, errs = _three_ranks(tmp_path, alike=True)
    assert codes == [2, 2, 2], errs
    assert errs == ["megarl error: checkpoint x: damaged. Fix: resume another.\n", "", ""]
