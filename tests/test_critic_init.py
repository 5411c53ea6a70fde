"""critic.hf_path: a reward model starts the PPO critic with its body and head, so the critic's first values are
transformers' scores of the same tokens; a causal LM gives its body under a value head of zeros, which start-up says;
start-up refuses a directory the critic cannot be built from, naming critic.hf_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_reward_model import TOKENIZER, make_reward_model

from helpers import REPO, make_hf_model
from megarl.errors import UserError


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The learner's critic from a Llama and a Qwen2 reward model (each under a policy of its shape but other
    weights), and from the policy itself (critic.hf_path null), in one worker process; its rows and its output."""
    root = tmp_path_factory.mktemp("critic")
    pairs = []
    for family in ("llama", "qwen2"):  # Llama's embeddings untied: a reward model has no lm_head.weight to read
        policy = make_hf_model(root / f"{family}_policy", family, seed=1)
        pairs.append(f"{policy}:{make_reward_model(root / f'{family}_rm', family, tokenizer=None)}")
    pairs.append(f"{root / 'qwen2_policy'}:-")
    out = root / "rows.json"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
                        "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "tests/workers/critic_init.py", str(out), *pairs], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_critic_from_a_reward_model_values_tokens_as_transformers_scores_them(built, family):
    rows, stdout = built
    row = next(r for r in rows if r["critic"].endswith(f"{family}_rm"))
    # float32 on CPU: the two implementations sum in other orders, ~1e-6; the scores themselves spread by ~1.
    for values, expected in zip(row["values"], row["hf_per_token"], strict=True):
        assert values == pytest.approx(expected[:-1], abs=1e-4)  # every position that predicts a next token
    assert row["last"] == pytest.approx(row["hf_last"], abs=1e-4)  # the reward model's score of each sequence
    assert max(abs(v) for v in row["hf_last"]) > 0.1
    assert f"megarl: critic: body and value head (score.weight) from the reward model {row['critic']}" in stdout


def test_a_critic_from_a_causal_lm_starts_its_value_head_at_zeros_and_says_so(built):
    rows, stdout = built
    row = next(r for r in rows if r["critic"] == "-")
    assert row["head_norm"] == 0 and all(v == 0 for values in row["values"] for v in values)
    assert f"megarl: critic: body from {row['policy']}, value head initialised to zeros" in stdout


def tiny_policys_reward_model(path: Path, **overrides: object) -> Path:
    """A random reward model of the tiny recipe's policy's shape (Qwen2, hidden 128, 2 layers, 18 ids)."""
    config = json.loads((TOKENIZER / "config.json").read_text())
    shape = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}
    return make_reward_model(path, "qwen2", **(shape | {"rope_theta": 10000.0} | overrides))


def check_critic(tmp_path: Path, critic: Path, *more: str):
    from megarl.loop.bootstrap import check_run

    return check_run(str(REPO / "recipes/tiny_cpu_ppo.yaml"), [f"critic.hf_path={critic}",
                                                               f"checkpoint.dir={tmp_path / 'run'}", *more],
                     world=1, ranks_per_node=None, gpu_bytes=0)


def refused(tmp_path: Path, critic: Path, *words: str) -> str:
    with pytest.raises(UserError) as info:
        check_critic(tmp_path, critic)
    message = str(info.value)
    assert all(w in message for w in (f"critic.hf_path = {str(critic)!r}", *words)), message
    return message


def test_start_up_refuses_a_critic_directory_it_cannot_build_the_critic_from(tmp_path):
    """check_run, before anything is built: a reward model of the policy's shape passes (and is not checked for
    GRPO, which has no critic); another shape, more than one label or a head of another width is refused, naming
    critic.hf_path, what differs and the fix."""
    from safetensors.torch import load_file, save_file

    assert check_critic(tmp_path, tiny_policys_reward_model(tmp_path / "rm"))
    other = make_reward_model(tmp_path / "other", "qwen2")  # the tests' tiny Qwen2, not the recipe's policy
    refused(tmp_path, other, "vocab_size 150 against the policy's 18", "hidden_size 64 against the policy's 128",
            "num_hidden_layers 4 against the policy's 2", "critic.hf_path: null")
    assert check_critic(tmp_path, other, "algorithm.name=grpo", "algorithm.kl_coef=0")
    # the same tensors' shapes, but layers that compute otherwise: the critic would not score as the reward model
    refused(tmp_path, tiny_policys_reward_model(tmp_path / "rope", rope_theta=1e6),
            "rope_theta 1000000.0 against the policy's 10000.0")
    refused(tmp_path, tiny_policys_reward_model(tmp_path / "two", num_labels=2), "num_labels = 2")
    narrow = tiny_policys_reward_model(tmp_path / "narrow")
    tensors = load_file(str(narrow / "model.safetensors"))
    tensors["score.weight"] = tensors["score.weight"][:, :32].contiguous()
    save_file(tensors, str(narrow / "model.safetensors"), metadata={"format": "pt"})
    refused(tmp_path, narrow, "score.weight", "[1, 32]", "[1, 128]")
