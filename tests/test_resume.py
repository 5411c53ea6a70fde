"""What a resume reads back besides the weights: the experiment it continues must be the checkpoint's (a change
is refused naming each field, unless checkpoint.allow_changes lists it; the layout may change), and a
metrics.jsonl whose last line a crash cut short is tolerated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.checkpoint.resume_check import check_unchanged
from megarl.config import load_config
from megarl.config.yaml_io import FieldError
from megarl.errors import UserError
from megarl.run.tracking import forget_jsonl_steps

REPO = Path(__file__).resolve().parents[1]


def config(recipe: str = "grpo", *overrides: str):
    return load_config(REPO / f"recipes/tiny_cpu_{recipe}.yaml", list(overrides))


def saved_checkpoint(tmp_path: Path, cfg, roles=("actor",)) -> Path:
    """A checkpoint's trainer.json as training writes it (with its config), and its models' directories."""
    path = tmp_path / "step_000003"
    for role in roles:
        (path / role).mkdir(parents=True)
    (path / "trainer.json").write_text(json.dumps({"step": 3, "config": cfg.to_flat_dict()}))
    return path


def test_a_resume_with_a_changed_experiment_is_refused_naming_each_field(tmp_path):
    path = saved_checkpoint(tmp_path, config())
    changed = config("grpo", "rollout.num_samples_per_prompt=4", "data.num_prompts_per_step=16",
                     "model.dtype=bfloat16")
    with pytest.raises(UserError) as err:
        check_unchanged(changed, path, rank=0)
    message = str(err.value)
    for change in ("rollout.num_samples_per_prompt 8 -> 4", "data.num_prompts_per_step 32 -> 16",
                   "model.dtype float32 -> bfloat16"):
        assert change in message, message
    assert "checkpoint.allow_changes=data.num_prompts_per_step,model.dtype,rollout.num_samples_per_prompt" in message


def test_a_lora_run_resumed_without_lora_or_the_reverse_is_refused_before_anything_loads(tmp_path):
    """actor.lora set on one side and null on the other flattens to keys the two configs do not share: the resume
    went on and failed later calling the checkpoint damaged (LoRA -> null: its optimizer lacks the base weights'
    state). It is a change of the experiment, named with what each side has."""
    lora = config("grpo", "actor.lora.rank=8")
    with pytest.raises(UserError) as err:
        check_unchanged(config(), saved_checkpoint(tmp_path / "a", lora), rank=0)
    message = str(err.value)
    assert 'saved with actor.lora {"rank": 8, "alpha": 16.0' in message and "sets actor.lora: null" in message
    assert "--merge" in message and "damaged" not in message, message
    with pytest.raises(UserError, match=r"saved with actor.lora null, and this config sets actor.lora: \{\"rank\": 8"):
        check_unchanged(lora, saved_checkpoint(tmp_path / "b", config()), rank=0)
    check_unchanged(lora, saved_checkpoint(tmp_path / "c", lora), rank=0)
    with pytest.raises(UserError, match="neither resumes as the other"):  # allow_changes cannot name it
        check_unchanged(config("grpo", "checkpoint.allow_changes=actor.lora.rank"), saved_checkpoint(tmp_path / "d",
                                                                                                    lora), rank=0)


def test_a_judge_turned_on_at_resume_is_refused_unless_its_fields_are_allowed(tmp_path, capsys):
    """A judge holds no state of the run: like reward_model.path, turning it on is a change allow_changes may
    name (by its fields: the section itself is no field)."""
    judged = ("reward_model.judge.model=recipes/tiny/model",)
    path = saved_checkpoint(tmp_path, config())
    with pytest.raises(UserError, match=r"saved with reward_model.judge null.*allow_changes \(e.g. "
                                        r"reward_model.judge.model\)"):
        check_unchanged(config("grpo", *judged), path, rank=0)
    check_unchanged(config("grpo", *judged, "checkpoint.allow_changes=reward_model.judge.model"), path, rank=0)
    assert "with reward_model.judge null -> {" in capsys.readouterr().out


def test_listed_changes_resume_with_a_line_naming_them(tmp_path, capsys):
    path = saved_checkpoint(tmp_path, config())
    check_unchanged(config("grpo", "rollout.num_samples_per_prompt=4", "checkpoint.allow_changes="
                                   "rollout.num_samples_per_prompt"), path, rank=0)
    assert "with rollout.num_samples_per_prompt 8 -> 4 (checkpoint.allow_changes)" in capsys.readouterr().out
    with pytest.raises(UserError, match="model.dtype float32 -> bfloat16") as err:  # a listed one lets no other pass
        check_unchanged(config("grpo", "rollout.num_samples_per_prompt=4", "model.dtype=bfloat16",
                               "checkpoint.allow_changes=rollout.num_samples_per_prompt"), path, rank=0)
    assert "num_samples_per_prompt" not in str(err.value).split(". ")[0]


def test_layout_and_run_length_may_change(tmp_path, capsys):
    path = saved_checkpoint(tmp_path, config("ppo"), roles=("actor", "critic"))
    check_unchanged(config("ppo", "parallel.tensor_parallel=2", "parallel.pipeline_parallel=2",
                           "actor.optimizer.use_distributed_optimizer=false", "critic.micro_batch_size=4",
                           "actor.dynamic_batch=false", "trainer.num_steps=500", "rollout.tensor_parallel=2",
                           "actor.offload_optimizer=false", "tracking.backend=none"), path, rank=0)
    assert capsys.readouterr().out == ""


def test_a_longer_run_under_a_decaying_learning_rate_says_how_the_rate_moves(tmp_path, capsys):
    """trainer.num_steps may change, but under a cosine decay the rate at the resumed step jumps: one line says so,
    naming the optimizer (the critic's constant schedule is not named)."""
    path = saved_checkpoint(tmp_path, config("ppo", "actor.optimizer.lr_schedule=cosine", "trainer.num_steps=8"),
                            roles=("actor", "critic"))
    check_unchanged(config("ppo", "actor.optimizer.lr_schedule=cosine", "trainer.num_steps=16"), path, rank=0)
    out = capsys.readouterr().out
    assert "trainer.num_steps 8 -> 16 re-sizes the learning-rate decay: after 4 steps actor.optimizer" in out
    assert "critic.optimizer" not in out


def test_a_grpo_checkpoint_resumed_as_ppo_says_so(tmp_path):
    path = saved_checkpoint(tmp_path, config("grpo"))
    ppo = config("ppo", "algorithm.kl_coef=0.0")
    with pytest.raises(UserError, match="algorithm grpo -> ppo"):
        check_unchanged(ppo, path, rank=0)
    with pytest.raises(UserError, match="algorithm grpo -> ppo"):  # even when listed: there is no critic to load
        check_unchanged(config("ppo", "checkpoint.allow_changes=algorithm.name"), path, rank=0)


def test_a_checkpoint_without_a_config_resumes_with_a_line_saying_it_is_not_compared(tmp_path, capsys):
    path = saved_checkpoint(tmp_path, config())
    (path / "trainer.json").write_text(json.dumps({"step": 3}))
    check_unchanged(config("grpo", "rollout.num_samples_per_prompt=4"), path, rank=0)
    assert "holds no config" in capsys.readouterr().out


@pytest.mark.parametrize("key", ["parallel.tensor_parallel", "rollout.num_sample_per_prompt",
                                 "actor.optimizer.use_distributed_optimizer"])
def test_allow_changes_names_only_fields_that_define_the_experiment(key):
    with pytest.raises(FieldError, match=f"checkpoint.allow_changes.*`{key}` is not"):
        config("grpo", f"checkpoint.allow_changes=rollout.seed, {key}")


@pytest.mark.parametrize("key", ["data.seed", "trainer.seed"])
def test_allow_changes_refuses_seeds_a_resume_restores_from_the_checkpoint(key):
    """The resume announced the change, then restored the checkpoint's prompt order or random state over it."""
    with pytest.raises(FieldError, match=f"not name `{key}`: a resume .* announced and not made"):
        config("grpo", f"checkpoint.allow_changes={key}")


def test_a_fixed_kl_coefficient_is_the_configs_on_resume_and_an_adaptive_one_the_checkpoints():
    """checkpoint.allow_changes=algorithm.kl_coef was announced, then the checkpoint's value restored over it."""
    from megarl.algos.kl import AdaptiveKLController, FixedKLController

    fixed, adaptive = FixedKLController(0.05), AdaptiveKLController(0.05, target=6.0, horizon=10000)
    fixed.load_state_dict(FixedKLController(0.01).state_dict())
    adaptive.load_state_dict({"value": 0.013})
    assert (fixed.value, adaptive.value) == (0.05, 0.013)


def test_a_kl_run_resumes_only_with_the_reference_weights_it_was_held_to(tmp_path):
    """The KL reference is built from model.hf_path again on resume: other weights at the same path (a re-download,
    a moved link) changed the KL without a word; the path alone was compared."""
    import shutil

    from megarl.checkpoint import manifest

    model = tmp_path / "model"
    shutil.copytree(REPO / "recipes/tiny/model", model)
    cfg = config("grpo", f"model.hf_path={model}", "algorithm.kl_coef=0.01")
    path = saved_checkpoint(tmp_path, cfg)
    state = json.loads((path / "trainer.json").read_text())
    (path / "trainer.json").write_text(json.dumps(state | {"reference": manifest.weight_files(str(model))}))
    check_unchanged(cfg, path, rank=0)
    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"was held to the KL reference at .* differ from model.hf_path = .*"
                                        r"allow_changes=model.hf_path"):
        check_unchanged(cfg, path, rank=0)
    check_unchanged(config("grpo", f"model.hf_path={model}", "algorithm.kl_coef=0.01",
                           "checkpoint.allow_changes=model.hf_path"), path, rank=0)


def test_a_metrics_line_cut_short_by_a_crash_is_set_aside_on_resume(tmp_path, capsys):
    rows = [json.dumps({"step": s, "reward_mean": 0.1 * s}) for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n" + rows[3][:-9])
    forget_jsonl_steps(tmp_path, 3)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == rows[:3]
    assert (tmp_path / "metrics.discarded.jsonl").read_text().splitlines() == [rows[3], rows[3][:-9]]
    assert "the last line of" in capsys.readouterr().out


def test_a_damaged_metrics_line_before_the_last_is_an_error(tmp_path):
    rows = [json.dumps({"step": s}) for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join([rows[0], rows[1][:5], rows[2]]) + "\n")
    with pytest.raises(UserError, match="metrics.jsonl line 2 is damaged"):
        forget_jsonl_steps(tmp_path, 1)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3  # left as it was


def test_a_long_run_without_periodic_checkpoints_is_warned_at_start_up():
    from megarl.checkpoint.notes import no_checkpoint_note

    note = no_checkpoint_note(config("grpo", "trainer.num_steps=200"))
    assert note is not None and "checkpoint.save_every = 0: this run of 200 steps saves no checkpoint" in note
    assert no_checkpoint_note(config("grpo", "trainer.num_steps=5")) is None  # a smoke run
    # no checkpoint.dir at all: its fix names the directory too (save_every alone would be refused)
    assert "checkpoint.dir is null" in (no_checkpoint_note(config("grpo", "trainer.num_steps=200",
                                                                  "checkpoint.dir=null")) or "")
    assert no_checkpoint_note(config("grpo", "trainer.num_steps=200", "checkpoint.dir=runs/x",
                                     "checkpoint.save_every=20")) is None
