"""On-policy distillation (distill.teacher): the objective against a batch computed by hand, the teacher checks at
start-up, the memory plan, and a tiny student that learns the echo task from a teacher alone, with no reward."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import REPO, run_worker, train_recipe
from megarl.algos.distill import reverse_kl_advantages
from megarl.config import AlgorithmConfig, Config, build_config
from megarl.config.experiment import defines_experiment
from megarl.errors import UserError
from megarl.loop.rl_step import actor_loss

TINY, TEACHER = REPO / "recipes/tiny/model", REPO / "recipes/tiny/teacher"


def test_reverse_kl_is_each_tokens_own_negative_advantage_and_its_gradient_is_the_hand_computed_one():
    """Thinking Machines' form: A_t = -coef (log pi_s(x_t) - log pi_t(x_t)), discount 0, tool tokens and padding 0.
    On policy (ratio 1, nothing clipped), d loss / d log pi_s(x_t) = -w_t A_t with w the token-mean weights."""
    student = torch.tensor([[-0.5, -1.25, -2.0, 0.0], [-0.1, -3.0, 0.0, 0.0]])
    teacher = torch.tensor([[-0.25, -2.0, -0.5, -9.0], [-1.1, -0.5, -7.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # sample 0's third token: a tool token
    adv, metrics = reverse_kl_advantages(student, teacher, mask, coef=0.5)
    expected = torch.tensor([[0.125, -0.375, 0.0, 0.0], [-0.5, 1.25, 0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-6, rtol=0)
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.25 + 0.75 + 1.0 - 2.5) / 4, abs=1e-6)
    assert metrics["distill/teacher_logprob"] == pytest.approx((-0.25 - 2.0 - 1.1 - 0.5) / 4, abs=1e-6)

    logp = student.clone().requires_grad_(True)
    weights = mask / mask.sum()
    loss, _ = actor_loss(logp, {"old_logprobs": student, "advantages": adv, "weights": weights},
                         AlgorithmConfig(), kl_coef=0.0)
    loss.backward()
    assert logp.grad is not None
    assert torch.allclose(logp.grad, -weights * expected, atol=1e-6, rtol=0)
    assert float(loss) == pytest.approx(float(-(weights * expected).sum()), abs=1e-6)


def test_the_loss_form_has_the_advantage_forms_gradient_on_policy():
    """distill.form loss: coef x 0.5 (log pi_s - log pi_t)^2 per token, whose gradient coef (log pi_s - log pi_t) is
    the advantage form's at ratio 1 (float32, 1e-6); its value is the k2 estimate, weighted."""
    gen = torch.Generator().manual_seed(0)
    student, teacher = -torch.rand(3, 5, generator=gen) * 3, -torch.rand(3, 5, generator=gen) * 3
    mask = (torch.rand(3, 5, generator=gen) > 0.3).float()
    weights = mask / mask.sum()
    adv, _ = reverse_kl_advantages(student, teacher, mask, coef=0.7)
    grads = []
    for extras, distill_coef in (({"advantages": adv}, 0.0),
                                 ({"advantages": torch.zeros_like(adv), "teacher_logprobs": teacher}, 0.7)):
        logp = student.clone().requires_grad_(True)
        loss, metrics = actor_loss(logp, {"old_logprobs": student, "weights": weights, **extras}, AlgorithmConfig(),
                                   kl_coef=0.0, distill_coef=distill_coef)
        loss.backward()
        grads.append(logp.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=0)
    assert torch.allclose(grads[1], 0.7 * (student - teacher) * weights, atol=1e-6, rtol=0)
    assert float(metrics["distill_loss"]) == pytest.approx(float((0.5 * (student - teacher) ** 2 * weights).sum()),
                                                           abs=1e-6)


def _teacher_with(tmp_path, edit) -> str:
    out = tmp_path / "teacher"
    shutil.copytree(TEACHER, out)
    edit(out)
    return str(out)


def _flip_a_weight_byte(model: str) -> None:
    path = sorted(Path(model).glob("*.safetensors"))[0]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))


def test_a_resume_finds_its_teacher_by_its_weights_not_its_path(tmp_path):
    """The checkpoint records the teacher's weight files (sizes, CRC-32s): other weights at the same path are
    another experiment, refused naming distill.teacher unless checkpoint.allow_changes lists it."""
    from megarl.checkpoint import manifest
    from megarl.checkpoint.resume_check import check_unchanged
    from megarl.config import load_config

    teacher = _teacher_with(tmp_path, lambda out: None)
    sets = [f"checkpoint.dir={tmp_path / 'run'}", f"distill.teacher={teacher}"]
    cfg = load_config(REPO / "recipes/tiny_cpu_grpo.yaml", sets)
    step = tmp_path / "run" / "step_000003"
    step.mkdir(parents=True)
    (step / "trainer.json").write_text(json.dumps({"config": cfg.to_flat_dict(),
                                                   "teacher": manifest.weight_files(teacher)}))
    check_unchanged(cfg, step, 0)
    _flip_a_weight_byte(teacher)
    refused = r"learned from the teacher at .*differ from distill.teacher = .*'model.safetensors'.*allow_changes="
    with pytest.raises(UserError, match=refused):
        check_unchanged(cfg, step, 0)
    allowed = load_config(REPO / "recipes/tiny_cpu_grpo.yaml", [*sets, "checkpoint.allow_changes=distill.teacher"])
    check_unchanged(allowed, step, 0)
    # On two ranks: rank 0 alone reads the teacher's files, and both refuse.
    rows = run_worker("teacher_check.py", tmp_path, step, teacher, nproc=2)
    assert [(r["rank"], r["reads"]) for r in rows] == [(0, 1), (1, 0)]
    assert all(r["refused"] and re.search(refused, r["refused"]) for r in rows), rows


def _check(teacher: str, tmp_path, *more: str):
    from megarl.loop.bootstrap import check_run

    return check_run(str(REPO / "recipes/tiny_cpu_grpo.yaml"), [f"distill.teacher={teacher}",
                                                                 f"checkpoint.dir={tmp_path / 'run'}", *more],
                     world=1, ranks_per_node=None, gpu_bytes=0)


def test_a_teacher_with_another_tokenizer_or_fewer_rows_is_refused_at_start_up(tmp_path):
    def swap(out):  # two tokens trade ids: the same size, another meaning
        path = out / "tokenizer.json"
        tok = json.loads(path.read_text())
        vocab = tok["model"]["vocab"]
        vocab["7"], vocab["8"] = vocab["8"], vocab["7"]
        path.write_text(json.dumps(tok))

    with pytest.raises(UserError, match=r"distill.teacher = '.*teacher' has another tokenizer than model.hf_path = "
                                        r"'recipes/tiny/model': 19 tokens against 19, and they differ at 4"):
        _check(_teacher_with(tmp_path / "a", swap), tmp_path)

    def shrink(out):
        config = json.loads((out / "config.json").read_text())
        config["vocab_size"] = 10
        (out / "config.json").write_text(json.dumps(config))

    with pytest.raises(UserError, match=r"has 10 output rows .* fewer than the student's 18"):
        _check(_teacher_with(tmp_path / "b", shrink), tmp_path)
    assert _check(str(TEACHER), tmp_path)[0].distill.teacher == str(TEACHER)
    with pytest.raises(UserError, match=r'^config key `distill.teacher` = ".*/nowhere", but it must be a HuggingFace '
                                        r"model directory .* \(there is no such directory\)"):
        _check(str(tmp_path / "nowhere"), tmp_path)  # it said "model directory ... does not exist", of which model?


def test_no_reward_needs_a_teacher_and_evaluation_its_own_reward():
    base = {"model": {"hf_path": str(TINY)}, "data": {"train_path": "x.jsonl"}}
    with pytest.raises(UserError, match=r"`trainer.reward` = null, but it must name a reward function unless "
                                        r"distill.teacher or reward_model.path is set"):
        build_config(base | {"trainer": {"reward": None}})
    with pytest.raises(UserError, match=r"`eval.datasets\[0\].reward` = null"):
        build_config(base | {"trainer": {"reward": None}, "distill": {"teacher": str(TEACHER)},
                             "eval": {"datasets": [{"name": "echo", "path": "x.jsonl"}]}})
    assert defines_experiment("distill.teacher", Config) and defines_experiment("distill.coef", Config)
    assert not defines_experiment("distill.offload_weights", Config)


def test_the_memory_plan_counts_the_teacher_in_its_phase_or_throughout():
    from megarl.distributed.parallel import ParallelDims
    from megarl.memory.plan import plan_memory
    from megarl.models.spec import load_spec

    def plan(offload: bool):
        cfg = build_config({"model": {"hf_path": str(TINY)}, "data": {"train_path": "x.jsonl"},
                            "rollout": {"engine": "vllm", "gpu_memory_fraction": 0.3},
                            "distill": {"teacher": str(TEACHER), "offload_weights": offload}})
        return plan_memory(cfg, load_spec(str(TINY)), ParallelDims(tp=1, pp=1, dp=1), 80 * 2**30)

    offloaded, resident = plan(True), plan(False)
    weights = offloaded.phases["teacher"]["teacher weights"]
    assert weights == offloaded.phases["actor_update"]["actor weights"]  # the same shape as the student, frozen
    assert "teacher weights" not in offloaded.phases["actor_update"] and offloaded.host["teacher weights"] == weights
    assert resident.phases["actor_update"]["teacher weights"] == weights and "teacher weights" not in resident.host


@pytest.mark.slow
def test_a_student_learns_the_echo_task_from_the_teacher_alone(tmp_path):
    """The teacher: the tiny model after 300 GRPO steps on echo (scripts/make_tiny_teacher.sh; 0.68 reward at
    temperature 1). The student: the tiny model, with no reward at all. Measured at seed 0: held-out echo accuracy
    0.006 -> 0.105 in 60 steps, reverse KL per token 7.6 -> 2.3, top-1 agreement with the teacher 0.01 -> 0.55."""
    teacher = _teacher_with(tmp_path, lambda out: None)
    run = tmp_path / "run"
    sets = ["trainer.num_steps=60", f"distill.teacher={teacher}", "trainer.reward=null", "eval.before_train=true",
            "eval.every=60", "eval.temperature=1.0", "eval.num_samples=4", "tracking.backend=none",
            "checkpoint.save_every=60"]
    held_out = ('eval.datasets=[{name: echo, path: recipes/tiny/echo.jsonl, reward: "megarl.rewards.echo:reward", '
                'max_prompts: 128}]')
    rows = train_recipe("recipes/tiny_cpu_grpo.yaml", run, *sets, held_out)
    assert all(r["reward_mean"] == 0 for r in rows)  # nothing but the teacher
    before, after = rows[0]["eval/echo/initial/accuracy"], rows[-1]["eval/echo/accuracy"]
    assert after > before + 0.05, (before, after)
    first = sum(r["distill/reverse_kl"] for r in rows[:5]) / 5
    last = sum(r["distill/reverse_kl"] for r in rows[-5:]) / 5
    assert last < first / 2, (first, last)
    agree = [sum(r["distill/top1_agreement"] for r in part) / 5 for part in (rows[:5], rows[-5:])]
    assert agree[1] > agree[0] + 0.2, agree
    # The checkpoint knows its teacher by its weights: the same path holding other weights is refused at a resume.
    from megarl.checkpoint.resume_check import check_unchanged
    from megarl.config import load_config

    step = run / "step_000059"
    cfg = load_config(REPO / "recipes/tiny_cpu_grpo.yaml", [f"checkpoint.dir={run}", *sets[:-1], held_out])
    check_unchanged(cfg, step, 0)
    _flip_a_weight_byte(teacher)
    with pytest.raises(UserError, match=r"distill.teacher = .*'model.safetensors'.*allow_changes=distill.teacher"):
        check_unchanged(cfg, step, 0)


class ScriptedScorer:
    """A model's scoring pass that returns ``short`` fewer values per sequence than it predicts (with the most
    likely token beside each logprob, as distillation asks of the actor and the teacher)."""

    replay = None

    def __init__(self, short: int = 0) -> None:
        self.short = short

    def score(self, sequences, max_tokens, micro_batch_size, routing=None, top1=False):
        return [torch.stack([torch.full((len(s) - 1 - self.short,), -0.5),
                             torch.zeros(len(s) - 1 - self.short)], dim=-1) for s in sequences]


def scoring_learner(teacher: ScriptedScorer):
    """The learner's scoring on one CPU rank, with scripted models in place of the actor and the teacher."""
    from types import SimpleNamespace

    from megarl.loop.learner import Learner

    learner = Learner.__new__(Learner)
    section = SimpleNamespace(dynamic_batch=False, max_tokens_per_gpu=None, micro_batch_size=1)
    learner.cfg = SimpleNamespace(actor=section, critic=section)  # type: ignore[assignment]
    learner.groups = SimpleNamespace(dp_rank=0, dims=SimpleNamespace(dp=1, pp=1),  # type: ignore[assignment]
                                     device=torch.device("cpu"))
    learner.actor, learner.teacher, learner.critic = ScriptedScorer(), teacher, None  # type: ignore[assignment]
    learner.top1 = {}
    learner.hold = lambda phase: None  # type: ignore[method-assign]
    return learner


def test_a_teacher_that_returns_logprobs_of_the_wrong_length_stops_the_step_naming_it():
    """Rows shorter than their sequences were padded with zeros into the batch, and trained on as a teacher
    certain of every token past them (reverse KL log pi_student - 0); longer ones failed deep in a tensor copy."""
    from megarl.loop.learner import ScoringFailed
    from megarl.loop.rl_step import Batch

    batch = Batch.build([[1, 2], [3]], [[4, 5, 6], [7]], [[-0.5] * 3, [-0.5]], [0.0, 1.0])
    whole = scoring_learner(ScriptedScorer())
    assert whole.score(batch, whole.teacher).tolist() == [[-0.5] * 4, [-0.5, 0.0, 0.0, 0.0]]
    for short in (1, -1):
        learner = scoring_learner(ScriptedScorer(short))
        with pytest.raises(ScoringFailed, match=r"the teacher's scoring pass returned (3|5) values for sequence 0 "
                                                r"of the batch, which predicts 4 tokens"):
            learner.score(batch, learner.teacher)
