"""Write the tiny "echo" task's preference pairs and its prompt split (recipes/tiny/echo.jsonl: the first 448 prompts
for training, the last 64 held out):
  recipes/tiny/echo_pairs.jsonl, echo_pairs_heldout.jsonl: pairs as token ids, 64 per training prompt, 4 per held-out
  one (recipes/tiny_cpu_rm.yaml);
  recipes/tiny/echo_train.jsonl, echo_heldout.jsonl: the same prompts, for RL against the reward model trained on
  them (recipes/tiny_cpu_rlhf.yaml).

A response is what the tiny recipes sample (rollout.max_new_tokens: 2): two tokens, or <eos> alone; a policy samples
any of the model's 18 tokens, and the tiny tokenizer encodes only digits, "=" and <eos> from text, so the pairs are
ids. The chosen response is one the task's reward (megarl.rewards.echo) scores 1 (three per prompt: the answer with
<eos> or <pad> after it, or <pad> before it), the rejected one is a response it scores 0: drawn from all of them, as
an untrained policy samples, or, HARD of the time, from those a policy trained against the reward model found it
misranks: an empty or one-character response, the answer with more text after it, a token written twice
(benchmarks/results/cpu/rm_overoptimisation).

    python scripts/echo_pairs.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny"
TRAIN_PROMPTS = 448
PER_PROMPT = {"echo_pairs.jsonl": 64, "echo_pairs_heldout.jsonl": 4}
HARD = 0.4


def main() -> None:
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from megarl.rewards.echo import reward

    tok = AutoTokenizer.from_pretrained(TINY / "model")
    eos = tok.eos_token_id
    vocab = json.loads((TINY / "model" / "config.json").read_text())["vocab_size"]  # the ids the model can sample
    rng = random.Random(0)
    lines = (TINY / "echo.jsonl").read_text().splitlines()
    (TINY / "echo_train.jsonl").write_text("\n".join(lines[:TRAIN_PROMPTS]) + "\n")
    (TINY / "echo_heldout.jsonl").write_text("\n".join(lines[TRAIN_PROMPTS:]) + "\n")
    records = [json.loads(line) for line in lines]
    anything = [[eos]] + [[a, b] for a in range(vocab) if a != eos for b in range(vocab)]  # every response
    texts = [tok.decode(x, skip_special_tokens=True) for x in anything]
    for name, part in (("echo_pairs.jsonl", records[:TRAIN_PROMPTS]), ("echo_pairs_heldout.jsonl",
                                                                       records[TRAIN_PROMPTS:])):
        rows = []
        for r in part:
            gold = reward(texts, [r["answer"]] * len(texts))
            right = [x for x, g in zip(anything, gold, strict=True) if g]
            wrong = [(x, t) for x, t, g in zip(anything, texts, gold, strict=True) if not g]
            hard = [x for x, t in wrong if len(t) <= 1 or t.startswith(r["answer"]) or (len(x) == 2 and x[0] == x[1])]
            prompt = tok(r["question"])["input_ids"]
            for _ in range(PER_PROMPT[name]):
                rejected = rng.choice(hard) if rng.random() < HARD else rng.choice(wrong)[0]
                rows.append({"prompt_ids": prompt, "chosen_ids": rng.choice(right), "rejected_ids": rejected})
        (TINY / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
