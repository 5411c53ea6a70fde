"""Prompt loading (vendored GSM8K, jsonl, parquet, bad files), tokenization, loader resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from megarl.data.batching import tokenize_prompts
from megarl.data.loader import PromptLoader
from megarl.data.prompts import PromptRecord, load_prompts
from megarl.errors import UserError


def test_vendored_gsm8k() -> None:
    train, test = load_prompts("gsm8k"), load_prompts("gsm8k:test")
    assert (len(train), len(test)) == (7473, 1319)
    assert load_prompts("gsm8k:train") == train
    assert test[0].prompt.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert test[0].answer.endswith("#### 18")
    with pytest.raises(UserError, match="'gsm8k:dev' is not a vendored dataset"):
        load_prompts("gsm8k:dev")


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_jsonl_with_custom_keys(tmp_path: Path) -> None:
    path = write(tmp_path / "p.jsonl", '{"q": "1 + 1?", "a": 2}\n\n{"q": "2 + 2?", "a": "4", "extra": null}\n')
    assert load_prompts(path, prompt_key="q", answer_key="a") == [
        PromptRecord("1 + 1?", "2"),
        PromptRecord("2 + 2?", "4"),
    ]


def test_numeric_answers_are_written_as_numbers_the_reward_reads(tmp_path: Path) -> None:
    """JSON numbers as answers: str() wrote 1e16 as "1e+16" and 0.00005 as "5e-05", which the GSM8K reward reads
    as 1 and 5 (paying a wrong answer, refusing the right one); NaN and Infinity, which json reads, are refused."""
    from megarl.rewards.gsm8k import reward

    path = write(tmp_path / "n.jsonl", '{"q": "a", "a": 1e16}\n{"q": "b", "a": 0.00005}\n{"q": "c", "a": 2.5}\n'
                 '{"q": "d", "a": 7}\n')
    answers = [r.answer for r in load_prompts(path, prompt_key="q", answer_key="a")]
    assert answers == ["10000000000000000", "0.00005", "2.5", "7"]
    assert reward(["#### 10000000000000000", "#### 0.00005", "#### 1", "#### 5"], answers[:2] * 2) == [1, 1, 0, 0]
    for bad in ("NaN", "Infinity"):
        with pytest.raises(UserError, match=f"line 1: 'a' \\(data.answer_key\\) is {bad.lower()[:3]}"):
            load_prompts(write(tmp_path / "bad.jsonl", f'{{"q": "a", "a": {bad}}}\n'), prompt_key="q", answer_key="a")


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?"], "answer": ["1", "2"]}), path)
    assert load_prompts(str(path)) == [PromptRecord("a?", "1"), PromptRecord("b?", "2")]
    with pytest.raises(UserError, match="row 1 has no key 'prompt'"):
        load_prompts(str(path), prompt_key="prompt")


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.jsonl", '{"question": "a", "answer": "1"}\n{"question": "b",\n', "line 2 is not valid JSON"),
        ("list.jsonl", '["a", "1"]\n', "line 1 is a JSON list, not an object"),
        ("keys.jsonl", '{"prompt": "a", "answer": "1"}\n', "no key 'question' (data.prompt_key); its keys are"),
        ("answer.jsonl", '{"question": "a", "solution": "1"}\n', "no key 'answer' (data.answer_key)"),
        ("type.jsonl", '{"question": ["a"], "answer": "1"}\n', "is a list, not a string"),
        ("empty.jsonl", "\n", "holds no records"),
        ("blank.jsonl", '{"question": "a", "answer": "1"}\n{"question": "  ", "answer": "2"}\n',
         "line 2: 'question' (data.prompt_key) is empty"),
        ("data.csv", "question,answer\n", "suffix '.csv'"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = write(tmp_path / name, text)
    with pytest.raises(UserError, match="data.train_path") as err:
        load_prompts(path)
    assert expected in str(err.value)


def test_a_byte_that_is_not_utf8_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(UserError, match=r"line 2 is not UTF-8 text \(byte 0xe9 at column 18\)"):
        load_prompts(str(path))


def test_missing_keys_are_listed(tmp_path: Path) -> None:
    path = write(tmp_path / "keys.jsonl", '{"prompt": "a", "answer": "1"}\n')
    with pytest.raises(UserError, match=r"its keys are \['answer', 'prompt'\]"):
        load_prompts(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_a_prompt_that_encodes_to_no_tokens_names_its_line(tmp_path: Path) -> None:
    """Text of only characters the tokenizer drops reaches the engine as an empty prompt: refused at start-up,
    naming the file line, not at the step that samples it."""
    path = write(tmp_path / "p.jsonl", '{"question": "one two", "answer": "1"}\n{"question": "!?", "answer": "2"}\n')

    class DropsPunctuation:
        chat_template = None

        def __call__(self, prompts: list[str]) -> dict[str, list[list[int]]]:
            return {"input_ids": [[1] * len(p.replace("!", " ").replace("?", " ").split()) for p in prompts]}

    with pytest.raises(UserError, match=rf"{path} line 2: the prompt '!\?' encodes to no tokens \(1 of 2"):
        tokenize_prompts(load_prompts(path), DropsPunctuation(), apply_chat_template=False, max_prompt_tokens=8)


def word_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained here on a few strings (no hub access)."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<user>", "<assistant>"])
    tok.train_from_iterator(["one two three four five", "six seven"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=chat_template)


PROMPTS = [PromptRecord(" ".join(["one", "two", "three", "four", "five"][:n]), str(n)) for n in (1, 4, 2, 5, 3)]


def test_over_long_prompts_are_an_error_by_default() -> None:
    with pytest.raises(UserError) as err:
        tokenize_prompts(PROMPTS, word_tokenizer(), apply_chat_template=False, max_prompt_tokens=3, source="'x.jsonl'")
    message = str(err.value)
    assert "data.train_path = 'x.jsonl': 2 of 5 prompts are longer than rollout.max_prompt_tokens = 3" in message
    assert "record 4, has 5" in message and "data.drop_long_prompts: true" in message


def test_tokenize_drops_over_long_prompts_when_asked() -> None:
    tok = word_tokenizer()
    kept, dropped = tokenize_prompts(PROMPTS, tok, apply_chat_template=False, max_prompt_tokens=3, drop_long=True)
    # Word counts 1, 4, 2, 5, 3: the 4- and 5-word prompts go; order and answers are kept.
    assert dropped == 2
    assert [p.record.answer for p in kept] == ["1", "2", "3"]
    assert [p.tokens for p in kept] == [tok.convert_tokens_to_ids("one two three".split()[:n]) for n in (1, 2, 3)]
    # No chat template: apply_chat_template falls back to plain encoding.
    assert tokenize_prompts(PROMPTS, tok, apply_chat_template=True, max_prompt_tokens=3, drop_long=True) == (kept, 2)


def test_tokenize_with_chat_template_counts_template_tokens() -> None:
    template = (
        "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok = word_tokenizer(template)
    kept, dropped = tokenize_prompts(PROMPTS, tok, apply_chat_template=True, max_prompt_tokens=4, drop_long=True)
    # The template adds 2 tokens: lengths 3, 6, 4, 7, 5, so only 1- and 2-word prompts fit in 4.
    assert dropped == 3
    assert kept[1].tokens == tok.convert_tokens_to_ids(["<user>", "one", "two", "<assistant>"])
    assert tokenize_prompts([], tok, True, 4) == ([], 0)


def test_loader_epochs_are_shuffled_permutations() -> None:
    loader = PromptLoader(list(range(10)), batch_size=3, seed=1)
    epochs = [[x for _ in range(3) for x in next(loader)] for _ in range(2)]
    # 3 batches of 3 per epoch; the 10th item is the skipped tail, a different one each epoch here.
    assert all(len(set(epoch)) == 9 for epoch in epochs)
    assert epochs[0] != epochs[1]
    assert loader.epoch == 1
    assert next(PromptLoader(list(range(10)), batch_size=3, shuffle=False)) == [0, 1, 2]


def test_an_unshuffled_loader_cycles_through_every_item_and_resumes_where_it_was() -> None:
    """Unshuffled, a skipped tail was the same items every epoch (8 and 9 of 10 in batches of 4: never trained
    on); the items are a cycle instead, and a resume goes on as the uninterrupted run does."""
    loader = PromptLoader(list(range(10)), batch_size=4, shuffle=False)
    batches = [next(loader) for _ in range(5)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    assert (loader.epoch, loader.position) == (2, 0)
    for stop in range(1, 5):
        first = PromptLoader(list(range(10)), batch_size=4, shuffle=False)
        for _ in range(stop):
            next(first)
        resumed = PromptLoader(list(range(10)), batch_size=4, shuffle=False)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert [next(resumed) for _ in range(5 - stop)] == batches[stop:]


def test_loader_resume_matches_an_uninterrupted_run() -> None:
    items = [f"p{i}" for i in range(10)]
    uninterrupted = PromptLoader(items, batch_size=3, seed=7)
    expected = [next(uninterrupted) for _ in range(8)]
    first = PromptLoader(items, batch_size=3, seed=7)
    for _ in range(5):  # stop mid-epoch (epoch 1, after its 2nd batch)
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = PromptLoader(items, batch_size=3, seed=12345)  # the checkpoint's seed wins
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(3)] == expected[5:]


def test_loader_errors() -> None:
    with pytest.raises(UserError, match="data.num_prompts_per_step = 4, but the dataset has only 3"):
        PromptLoader([1, 2, 3], batch_size=4)
    state = PromptLoader(list(range(10)), batch_size=2).state_dict()
    with pytest.raises(UserError, match="over 10 prompts"):
        PromptLoader(list(range(9)), batch_size=2).load_state_dict(state)


def test_a_resume_over_as_many_but_other_prompts_is_refused_unless_allowed() -> None:
    """The loader's state says where in which order: over other prompts of the same count (another file, the same one
    edited) it would silently continue elsewhere. The items' keys are compared (the source line is not a key)."""
    records = [PromptRecord(f"q{i}", str(i), source=f"a.jsonl line {i}") for i in range(10)]
    key = lambda r: [r.prompt, r.answer]  # noqa: E731
    state = json.loads(json.dumps(PromptLoader(records, batch_size=2, key=key).state_dict()))
    moved = [PromptRecord(r.prompt, r.answer, source=f"b.jsonl line {i}") for i, r in enumerate(records)]
    PromptLoader(moved, batch_size=2, key=key).load_state_dict(state)  # the same prompts from another path
    edited = [*records[:9], PromptRecord("q9 edited", "9")]
    with pytest.raises(UserError, match="as many, but not the same ones.*allow_changes naming the field"):
        PromptLoader(edited, batch_size=2, key=key).load_state_dict(state)
    PromptLoader(edited, batch_size=2, key=key).load_state_dict(state, allow_other_items=True)
    del state["digest"]  # a checkpoint of a megarl before digests: not compared
    PromptLoader(edited, batch_size=2, key=key).load_state_dict(state)


def test_prompt_template_formats_record_fields(tmp_path: Path) -> None:
    path = write(tmp_path / "p.jsonl", '{"question": "1 + 1?", "unit": "apples", "answer": 2}\n')
    template = 'Q: {question} ({unit}) Output the answer after "####".'
    assert load_prompts(path, template=template) == [PromptRecord('Q: 1 + 1? (apples) Output the answer after "####".',
                                                                  "2")]
    with pytest.raises(UserError, match=r"line 1 has no key 'topic', which data.prompt_template names; its keys are "
                                        r"\['answer', 'question', 'unit'\]"):
        load_prompts(path, template="{topic}: {question}")
    with pytest.raises(UserError, match=r"data.prompt_template = .* names \{answer\}, the reference answer "
                                        r"\(data.answer_key\): every prompt would hold the answer"):
        load_prompts(path, template="{question} (hint: {answer})")
    with pytest.raises(UserError, match=r"names \{answer\}"):  # inside a format spec too
        load_prompts(path, template="{question:{answer}}")


@pytest.mark.parametrize(("template", "expected"), [("{question", "is not a format string"),
                                                     ("{} and {0}", "has the field {}, which is not a record key")])
def test_a_bad_prompt_template_is_refused_when_the_config_loads(template: str, expected: str) -> None:
    from megarl.config import DataConfig

    with pytest.raises(UserError, match="data.prompt_template") as err:
        DataConfig(train_path="gsm8k", prompt_template=template)
    assert expected in str(err.value)


def test_system_prompt_is_a_system_turn_or_leading_text() -> None:
    template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = word_tokenizer(chat_template=template)
    records = [PromptRecord("one two", "2")]
    chat, _ = tokenize_prompts(records, tok, apply_chat_template=True, max_prompt_tokens=16, system_prompt="six")
    assert tok.decode(chat[0].tokens) == tok.decode(tok("<system> six <user> one two <assistant>")["input_ids"])
    plain, _ = tokenize_prompts(records, tok, apply_chat_template=False, max_prompt_tokens=16, system_prompt="six")
    assert plain[0].tokens == tok("six\n\none two")["input_ids"]
    bare, _ = tokenize_prompts(records, tok, apply_chat_template=False, max_prompt_tokens=16)
    assert bare[0].tokens == tok("one two")["input_ids"]


def test_response_prefix_ends_the_prompt_as_its_own_tokens() -> None:
    template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = word_tokenizer(chat_template=template)
    records = [PromptRecord("one two", "2")]
    plain, _ = tokenize_prompts(records, tok, apply_chat_template=True, max_prompt_tokens=16)
    opened, _ = tokenize_prompts(records, tok, apply_chat_template=True, max_prompt_tokens=16, response_prefix="six")
    assert opened[0].tokens == plain[0].tokens + tok.encode("six", add_special_tokens=False)
    with pytest.raises(UserError, match="longer than rollout.max_prompt_tokens"):
        tokenize_prompts(records, tok, apply_chat_template=True, max_prompt_tokens=len(plain[0].tokens),
                         response_prefix="six")


@pytest.mark.parametrize("template", ["{question:d}", "{question!x}"])
def test_a_template_that_cannot_format_a_record_is_one_paragraph_naming_the_line(tmp_path: Path, template) -> None:
    path = write(tmp_path / "p.jsonl", '{"question": "1 + 1?", "answer": 2}\n')
    with pytest.raises(UserError, match=r"data.prompt_template = .* cannot format data.train_path .*line 1"):
        load_prompts(path, template=template)
