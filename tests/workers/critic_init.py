"""One-process worker for test_critic_init.py: the PPO critic the learner builds from critic.hf_path, in a gloo world
of one, against transformers' sequence classification of the same token ids.

python tests/workers/critic_init.py OUT_JSON POLICY_DIR:CRITIC_DIR...
A process of its own because megatron needs the CPU shim, which stays installed for the life of the process. CRITIC_DIR
"-" leaves critic.hf_path null. Writes, per pair, the critic's values and transformers' per-token and last-token
scores; test_critic_init.py judges them.
"""

import json
import sys

import torch

from megarl.platform import init_platform

platform = init_platform()

from megarl.config import build_config  # noqa: E402
from megarl.distributed.parallel import ParallelDims, init_distributed, init_model_parallel  # noqa: E402
from megarl.loop.learner import Learner  # noqa: E402
from megarl.models.reward_model import pad_token_id, score_sequences  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402

SEQUENCES = [[3, 17, 5, 9, 42, 8, 11, 2, 30], [7, 1, 19, 4, 6]]


def transformers_scores(critic_dir: str) -> dict:
    """Each token's score (the head on its last hidden state) and the sequence's score (transformers' logits)."""
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(critic_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        per_token = [hf.score(hf.model(torch.tensor([s])).last_hidden_state)[0, :, 0].tolist() for s in SEQUENCES]
        last = [float(hf(torch.tensor([s])).logits[0, 0]) for s in SEQUENCES]
    return {"hf_per_token": per_token, "hf_last": last}


def critic_values(policy: str, critic: str, groups) -> dict:
    """The learner's critic as a KL-PPO run builds it: values of every position but the last, and the value at the
    last token, read where a reward model's score is."""
    cfg = build_config({"model": {"hf_path": policy, "dtype": "float32"}, "algorithm": {"name": "ppo", "kl_coef": 0},
                        "critic": {"hf_path": None if critic == "-" else critic},
                        "data": {"train_path": "x", "num_prompts_per_step": 1}, "rollout": {"engine": "vllm"}})
    learner = Learner(cfg, groups, load_spec(policy))
    model = learner.critic
    values = model.score(SEQUENCES, None)
    last = score_sequences(model, groups, SEQUENCES, pad_token_id(model.spec))
    head = model.chunks[-1].output_layer.weight
    return {"values": [v.tolist() for v in values], "last": last, "head_norm": float(head.norm())}


def main() -> None:
    out, pairs = sys.argv[1], [p.split(":") for p in sys.argv[2:]]
    init_distributed(platform)
    groups = init_model_parallel(ParallelDims(tp=1, pp=1, dp=1))
    results = []
    for policy, critic in pairs:
        row = {"policy": policy, "critic": critic} | critic_values(policy, critic, groups)
        if critic != "-":
            row |= transformers_scores(critic)
        results.append(row)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
