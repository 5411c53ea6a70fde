"""Regenerate the tiny CPU recipe's model, tokenizer and data (recipes/tiny/): deterministic.

  python scripts/make_tiny_recipe.py

Task ("echo"): the prompt lists one or two digits; the answer repeats the last digit.
A random 2-layer model starts near chance (about 1 in 18 tokens) and GRPO teaches it within minutes
on a laptop CPU, which makes the recipes' learning curves a meaningful end-to-end check.
"""

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

OUT = Path(__file__).resolve().parent.parent / "recipes" / "tiny"
WORDS = ["<pad>", "<eos>", "=", "echo", *[str(d) for d in range(10)], "the", "last", "digit", "is"]


def main() -> None:
    vocab = {w: i for i, w in enumerate(WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    model_dir = OUT / "model"
    tok.save_pretrained(model_dir)
    torch.manual_seed(0)
    # head_dim 64: vLLM's CPU attention kernels reject smaller heads.
    config = Qwen2Config(vocab_size=len(WORDS), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=vocab["<eos>"],
                         pad_token_id=vocab["<pad>"])
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    rng = random.Random(0)
    rows = []
    for _ in range(512):
        digits = [str(rng.randrange(10)) for _ in range(rng.randrange(1, 3))]
        rows.append({"question": "echo " + " ".join(digits), "answer": digits[-1]})
    (OUT / "echo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
