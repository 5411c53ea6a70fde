"""Every shipped recipe loads, and the 8-GPU recipes validate for their model on 8 GPUs."""

import json
import re

import pytest

from helpers import REPO
from megarl.config import load_config, validate_layout
from megarl.config.reward_training import load_reward_training
from megarl.errors import UserError
from megarl.models.presets import PRESETS, preset_or_hf_spec

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_loads(recipe):
    """Every recipe loads: a reward model's (*_rm.yaml, `python -m megarl.train_rm`) as its command reads it, the others
    as RL runs."""
    if recipe.stem.endswith("_rm"):
        load_reward_training(recipe)
    else:
        load_config(recipe)


@pytest.mark.parametrize("recipe,preset", [("llama3_8b_ppo.yaml", "llama3-8b"), ("qwen2_7b_grpo.yaml", "qwen2-7b"),
                                           ("qwen3_8b_grpo.yaml", "qwen3-8b"),
                                           ("qwen3_30b_a3b_grpo.yaml", "qwen3-30b-a3b")])
def test_8b_recipes_validate_for_8_gpus(tmp_path, recipe, preset):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS[preset]))
    cfg = load_config(REPO / "recipes" / recipe, [f"model.hf_path={tmp_path}"])
    spec = preset_or_hf_spec(str(tmp_path))
    dp = validate_layout(cfg, 8, num_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
                         num_kv_heads=spec.num_kv_heads, vocab_size=spec.vocab_size)
    assert dp == 8 // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)
    assert cfg.algorithm.kl_coef == 0.02 and cfg.algorithm.entropy_coef == 0.01
    assert cfg.rollout.gpu_memory_fraction == 0.7 and cfg.actor.dynamic_batch
    if spec.is_moe:  # checked before launch (megarl.loop.bootstrap): Megatron's MoE layers under TP need it
        assert cfg.parallel.sequence_parallel


@pytest.mark.parametrize(("override", "expected"), [
    ("checkpoint.allow_changes=data.train_path", "= \"data.train_path\", but it must be null for reward-model"),
    ("training.optimizer.num_warmup_steps=400", "below trainer.num_steps (400)"),
])
def test_reward_model_training_refuses_what_it_would_ignore(override, expected):
    """train_rm's resume refuses every change to what its steps trained, and a warm-up as long as the run never
    reaches the learning rate: said when the recipe loads, not ignored."""
    with pytest.raises(UserError, match=re.escape(expected)):
        load_reward_training(REPO / "recipes" / "tiny_cpu_rm.yaml", [override, "trainer.num_steps=400"])
