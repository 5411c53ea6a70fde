"""Make a tiny random Llama (HF format) and token sequences for the quickstart; optionally check scores.

  python scripts/make_tiny_model.py --out DIR --tokens TOKENS.jsonl [--check LOGPROBS.jsonl]
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


def make(out: Path, tokens: Path) -> None:
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        LlamaForCausalLM(config).save_pretrained(out)
    gen = torch.Generator().manual_seed(0)
    lines = [json.dumps({"tokens": torch.randint(0, 256, (n,), generator=gen).tolist()}) for n in (8, 16, 5, 12)]
    tokens.write_text("\n".join(lines) + "\n")


def check(out: Path, tokens: Path, logprobs: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    worst = 0.0
    rows = [json.loads(line) for line in logprobs.read_text().splitlines()]
    for line, row in zip(tokens.read_text().splitlines(), rows, strict=True):
        seq = torch.tensor([json.loads(line)["tokens"]])
        with torch.no_grad():
            ref = torch.log_softmax(model(seq).logits[0, :-1], -1).gather(-1, seq[0, 1:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(row["logprobs"])).abs().max().item())
    print(f"megarl TP=2 vs transformers: max |logprob diff| = {worst:.2e} over {len(rows)} sequences")
    if worst > 1e-4:
        raise SystemExit("quickstart check FAILED: megarl and transformers disagree")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=Path, required=True)
    p.add_argument("--check", type=Path)
    args = p.parse_args()
    if args.check:
        check(args.out, args.tokens, args.check)
    else:
        make(args.out, args.tokens)
