"""Where the PPO critic starts (critic.hf_path, else model.hf_path). A causal LM gives its body under a value head of
zeros, a neutral baseline; a reward model (a `*ForSequenceClassification` with one label) gives its body and its head
``score.weight``, so that the critic's first values are the reward model's scores of the same tokens. Either way the
critic is built in the policy's shape (its checkpoints and exports are the policy's config), so the directory's body
must have that shape."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.distributed.parallel import ParallelGroups
from megarl.errors import UserError
from megarl.models.gpt import BuildOptions, load_hf_weights
from megarl.models.reward_model import load_body_spec, load_reward_weights, open_weights
from megarl.models.spec import ModelSpec

FIELD = "critic.hf_path"
SHAPE = {"family": "model_type", "vocab_size": "vocab_size", "hidden_size": "hidden_size",
         "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
         "num_attention_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
         "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "rope_scaling": "rope_scaling",
         "num_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
         "moe_intermediate_size": "moe_intermediate_size", "norm_topk_prob": "norm_topk_prob"}
"""The spec's fields the critic's body must share with the policy (config.json's names): its tensors' shapes and
what the layers compute with. Tied embeddings and the context length do not matter to a body under a value head."""


def check_critic_dir(hf_dir: str, policy: ModelSpec, policy_dir: str) -> bool:
    """At start-up, before anything is built: ``hf_dir`` (critic.hf_path) is a causal LM, or a reward model with one
    label and a head [1, hidden_size], whose body has the policy's shape. Returns whether it is a reward model."""
    from megarl.data.tokenizer import check_hf_config

    check_hf_config(hf_dir, FIELD)
    spec, reward = load_body_spec(hf_dir, FIELD)
    differ = [f"{name} {getattr(spec, f)!r} against the policy's {getattr(policy, f)!r}"
              for f, name in SHAPE.items() if getattr(spec, f) != getattr(policy, f)]
    if differ:
        raise UserError(f"{FIELD} = {hf_dir!r}: its body is not of the shape of model.hf_path = {policy_dir!r}: "
                        f"{', '.join(differ)} (config.json). The critic is built in the policy's shape and reads its "
                        f"body from {FIELD}, so these must be equal. Fix: use a causal LM or a reward model (a "
                        "*ForSequenceClassification with num_labels 1) of the policy's own base model, or set "
                        f"{FIELD}: null to start the critic from model.hf_path.")
    if reward:
        open_weights(spec, hf_dir, FIELD)  # the head's width and every tensor against config.json
    return reward


def critic_weights(hf_dir: str, groups: ParallelGroups, opts: BuildOptions
                   ) -> tuple[Callable[[list[torch.nn.Module]], None], str]:
    """How the critic's chunks load from ``hf_dir`` (MegatronModel's ``load``), and the start-up line that says
    where its body and value head come from. The directory's own spec reads it: a reward model has no LM head."""
    spec, reward = load_body_spec(hf_dir, FIELD)
    if reward:
        def load(chunks: list[torch.nn.Module]) -> None:
            load_reward_weights(chunks, spec, hf_dir, groups, opts, FIELD)

        return load, f"megarl: critic: body and value head (score.weight) from the reward model {hf_dir}"

    def load_body(chunks: list[torch.nn.Module]) -> None:
        load_hf_weights(chunks, spec, hf_dir, groups, opts)

    return load_body, f"megarl: critic: body from {hf_dir}, value head initialised to zeros"
