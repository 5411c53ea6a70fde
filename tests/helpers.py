"""Shared test helpers: tiny random HF models made locally (no hub), and multi-rank launches with a deadline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# A vocab that is not a multiple of 128 * TP exercises Megatron's vocab padding.
TINY = {
    "llama": dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(vocab_size=150, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=1000000.0, tie_word_embeddings=True),
    # head_dim 32 with 4 heads: the attention width (128) differs from hidden_size, as in Qwen3-4B.
    "qwen3": dict(vocab_size=170, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  rope_theta=1000000.0, tie_word_embeddings=True),
    # Qwen3-30B-A3B's kind: 8 experts of width 32, top-2 renormalised, in every layer.
    "qwen3_moe": dict(vocab_size=170, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      rope_theta=1000000.0, tie_word_embeddings=False),
}


def make_hf_model(path: Path, family: str, seed: int = 0, max_shard_size: str | None = None,
                  dtype: torch.dtype = torch.float32, **overrides: object) -> Path:
    """Save a random tiny Llama/Qwen2/Qwen3(-MoE) with transformers; weights ~N(0, 0.05) so logits are not flat,
    MoE routers ~N(0, 1) so that expert choices are clear-cut (float rounding does not flip them)."""
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[family]
    config_cls, model_cls = getattr(transformers, names + "Config"), getattr(transformers, names + "ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(TINY[family] | overrides)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 1.0 if name.endswith("mlp.gate.weight") else 0.05)
    model.to(dtype).save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous the test starts itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(target: list[str], nproc: int, timeout: float = 600, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
    """torchrun ``target`` (a script path or ["-m", module] plus args) on ``nproc`` CPU ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", *target]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"} | (env or {})
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_worker(worker: str, tmp_path: Path, *args: object, nproc: int = 4, env: dict[str, str] | None = None
               ) -> list[dict]:
    """torchrun ``tests/workers/<worker>`` with an output folder; the rows its ranks wrote to rank*.json."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    proc = run_torchrun([f"tests/workers/{worker}", str(out), *map(str, args)], nproc=nproc, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows: list[dict] = []
    for f in sorted(out.glob("rank*.json")):
        data = json.loads(f.read_text())
        rows += data if isinstance(data, list) else [data]
    return rows


def train_recipe(recipe: str, ckpt_dir: Path, *overrides: str, nproc: int = 1) -> list[dict]:
    """Run ``megarl/train.py`` on ``nproc`` ranks with ``checkpoint.dir`` = ckpt_dir; the metrics rows it logged."""
    import json

    sets = [arg for override in (f"checkpoint.dir={ckpt_dir}", *overrides) for arg in ("--set", override)]
    proc = run_torchrun(["megarl/train.py", "--config", recipe, *sets], nproc=nproc, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (ckpt_dir / "metrics.jsonl").read_text().splitlines()]


def zero_data(path: Path) -> None:
    """Zero a safetensors file's tensor bytes and leave its header as it was (the issue's damage)."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start:] = bytes(len(raw) - start)
    path.write_bytes(bytes(raw))


def check_resumed_equals_whole(engine, prompts, budgets: list[int], cut, whole, tol: float) -> None:
    """Every sample ``engine.generate_until`` aborted in ``cut``, resumed greedily from prompt + its tokens with the
    budget it has left, ends as the uncut one in ``whole``: tokens, finish reason, and logprobs within ``tol``."""
    from megarl.rollout.base import SamplingParams

    aborted = [i for i, c in enumerate(cut) if c.finish_reason == "abort"]
    more = engine.generate_until([list(prompts[i]) + cut[i].token_ids for i in aborted],
                                 SamplingParams(temperature=0, budgets=[budgets[i] - len(cut[i].token_ids)
                                                                        for i in aborted]), lambda done: False)
    for i, m in zip(aborted, more, strict=True):
        assert cut[i].token_ids + m.token_ids == whole[i].token_ids and m.finish_reason == whole[i].finish_reason
        worst = max(abs(a - b) for a, b in zip(cut[i].logprobs + m.logprobs, whole[i].logprobs, strict=True))
        assert worst < tol, worst


def threads_as_ranks(world: int):
    """torch.distributed.all_gather_object for ranks played by threads named "0", "1", ... in one process (patch it
    in): every thread gets every thread's part, in rank order, once all have given theirs."""
    import threading

    gathered: list[object] = [None] * world
    barrier = threading.Barrier(world, timeout=30)

    def all_gather(out: list, part: object, group: object = None) -> None:
        gathered[int(threading.current_thread().name)] = part
        barrier.wait()
        out[:] = list(gathered)
        barrier.wait()

    return all_gather


def only_mlflow_run(uri: str, name: str | None = None):
    """(client, run): the one mlflow run of experiment "megarl" in the store at ``uri`` (named ``name``, if given)."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("megarl").experiment_id],
                               filter_string=f"tags.mlflow.runName = '{name}'" if name else "")
    return client, run


def assert_mlflow_matches(client, run, rows: list[dict]) -> None:
    """The mlflow run holds exactly the metrics of ``rows`` (metrics.jsonl's), each with every step's value."""
    names = {k for row in rows for k in row} - {"step"}
    assert set(run.data.metrics) == names
    for name in names:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert history == [(r["step"], r[name]) for r in rows if name in r], name
