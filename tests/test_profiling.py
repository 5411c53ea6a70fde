"""train.py --profile STEP: the step's bounds and the trace it writes."""

import json

import pytest
import torch

from megarl.errors import UserError
from megarl.run.profiling import check_profile_step, profiled, trace_path


def test_profile_step_must_be_one_the_run_does():
    check_profile_step(None, 0, 10)
    check_profile_step(9, 5, 10)
    with pytest.raises(UserError, match=r"--profile 10: this run does steps 0 to 9 \(trainer.num_steps = 10\)"):
        check_profile_step(10, 0, 10)
    with pytest.raises(UserError, match="resuming at step 5"):
        check_profile_step(3, 5, 10)


def test_a_profiled_block_writes_a_chrome_trace_and_an_unprofiled_one_nothing(tmp_path):
    path = trace_path(tmp_path, 3, 1)
    with profiled(False, path):
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert not path.exists()
    with profiled(True, path):
        torch.ones(8, 8) @ torch.ones(8, 8)
    events = json.loads(path.read_text())["traceEvents"]
    assert path.name == "profile_step3_rank1.json" and any(e.get("name") == "aten::mm" for e in events)
    assert list(tmp_path.iterdir()) == [path]  # no partial file left
