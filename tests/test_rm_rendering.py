"""A conversation reads the same to a reward model in its training (megarl.rm.pairs) and in RL (the policy's own ids,
or the conversation rendered again with another tokenizer): a finished sample ends in the end token on every path, a
sample the token budget cut ends in none; train_rm warns where the pad token would hide the end token."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

from helpers import REPO
from megarl.config import build_config

TINY = REPO / "recipes" / "tiny" / "model"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer() -> Any:
    """A byte-level BPE with ChatML's template, whose turns end in <|im_end|> and a newline after it (Qwen's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["user assistant system be brief what is 2+2? the answer is 4\n five 5\n"] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                "<|im_end|>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def tokenizer_of(kind: str) -> Any:
    from megarl.data.tokenizer import load_tokenizer

    return chatml_tokenizer() if kind == "chatml" else load_tokenizer(str(TINY))


CASES = {"chatml": ("what is 2+2?", "the answer is 4", "be brief"), "plain": ("echo 6 0", " 0", None)}
"""Per tokenizer: the prompt, the response and data.system_prompt."""


def sample(kind: str, finished: bool) -> tuple[Any, Any, list[int], int, list[int]]:
    """The tokenizer, the run's config, a policy's sample of that tokenizer (prompt as megarl.data.batching renders
    it, the response's ids, with the EOS it stopped at when ``finished``), its prompt length and the stop ids."""
    from megarl.data.batching import tokenize_prompts
    from megarl.data.prompts import PromptRecord

    tokenizer = tokenizer_of(kind)
    prompt, response, system = CASES[kind]
    chat = kind == "chatml"
    cfg = build_config({"model": {"hf_path": "/m"}, "rollout": {"num_samples_per_prompt": 4},
                        "data": {"train_path": "x", "num_prompts_per_step": 16, "apply_chat_template": chat,
                                 "system_prompt": system}, "reward_model": {"path": "/rm"}})
    (rendered,), _ = tokenize_prompts([PromptRecord(prompt, "")], tokenizer, chat, 64, system_prompt=system)
    stop = [tokenizer.eos_token_id]
    ids = tokenizer.encode(response, add_special_tokens=False) + (stop if finished else [])
    return tokenizer, cfg, rendered.tokens + ids, len(rendered.tokens), stop


def rl_inputs(kind: str, finished: bool) -> tuple[list[int], list[int], list[int]]:
    """The reward model's ids of the sample in RL, its tokenizer the policy's (``shares_tokens``) and rendered
    again; and reward-model training's ids of the same conversation as a text pair ending in EOS."""
    from megarl.data.tokenizer import decoder
    from megarl.rewards.reward_model import reward_inputs
    from megarl.rm.pairs import conversation_ids

    tokenizer, cfg, seq, n, stop = sample(kind, finished)
    prompt, response, system = CASES[kind]
    shared, again = (reward_inputs([seq], [n], [prompt], stop, shares, tokenizer, decoder(tokenizer), cfg)[0]
                     for shares in (True, False))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    trained = conversation_ids(messages, [{"role": "assistant", "content": response}], tokenizer, kind == "chatml",
                               finished, "pairs.jsonl line 1")
    return shared, again, trained


@pytest.mark.parametrize("kind", ["chatml", "plain"])
def test_a_finished_sample_reads_as_reward_model_training_rendered_it(kind):
    shared, again, trained = rl_inputs(kind, finished=True)
    tokenizer = tokenizer_of(kind)
    end = tokenizer.convert_ids_to_tokens(trained[-1])
    assert end == tokenizer.eos_token  # scored at the end token, not at the template's newline after it
    assert again == trained == shared, [tokenizer.convert_ids_to_tokens(x) for x in (again, trained, shared)]


@pytest.mark.parametrize("kind", ["chatml", "plain"])
def test_a_sample_cut_by_the_token_budget_gets_no_end_token(kind):
    shared, again, unended = rl_inputs(kind, finished=False)
    tokenizer = tokenizer_of(kind)
    assert again[-1] != tokenizer.eos_token_id  # the template does not close the cut turn either
    assert again == shared == unended, [tokenizer.convert_ids_to_tokens(x) for x in (again, shared)]


def tiny_model(path, **config: object):
    shutil.copytree(TINY, path)
    original = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(original | config))
    return path


@pytest.mark.parametrize("pad, warned", [(1, True), (0, False)])
def test_train_rm_warns_when_the_pad_token_is_the_end_token(tmp_path, capsys, monkeypatch, pad, warned):
    """The tiny model's EOS is <eos> (id 1): with pad_token_id 1 the end token is never scored."""
    from megarl.rm.setup import prepare

    monkeypatch.delenv("RANK", raising=False)
    model = tiny_model(tmp_path / "model", pad_token_id=pad)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "echo 6 0", "chosen": " 0", "rejected": " 6"}) + "\n")
    prepare(str(REPO / "recipes/tiny_cpu_rm.yaml"), [f"model.hf_path={model}", f"data.train_path={pairs}",
                                                     "data.eval_path=null", "data.pairs_per_step=1",
                                                     f"checkpoint.dir={tmp_path / 'run'}"], world=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    if not warned:
        assert lines == []
        return
    assert len(lines) == 1 and "data.end_with_eos = true appends '<eos>' (id 1)" in lines[0], lines
    assert "pad_token_id" in lines[0] and "never read" in lines[0]
