"""Preference pairs (megarl.data.preferences): both file forms become the same messages; bad pairs are named."""

import json

import pytest

from megarl.data.preferences import load_pairs
from megarl.errors import UserError


def write(tmp_path, rows):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_text_pairs_and_whole_conversations_give_the_same_messages(tmp_path):
    user = {"role": "user", "content": "2+2?"}
    text = load_pairs(write(tmp_path, [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}]))
    whole = load_pairs(write(tmp_path, [{"chosen": [user, {"role": "assistant", "content": "4"}],
                                         "rejected": [user, {"role": "assistant", "content": "5"}]}]))
    assert [(p.prompt, p.chosen, p.rejected) for p in text] == [(p.prompt, p.chosen, p.rejected) for p in whole] == \
        [([user], [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}])]
    assert text[0].source.endswith("pairs.jsonl line 1")


def test_multi_turn_conversations_share_their_prompt_up_to_where_they_differ(tmp_path):
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
    pair, = load_pairs(write(tmp_path, [{"chosen": turns + [{"role": "assistant", "content": "4"}],
                                         "rejected": turns + [{"role": "assistant", "content": "22"}]}]))
    assert pair.prompt == turns and pair.chosen[0]["content"] == "4" and pair.rejected[0]["content"] == "22"


@pytest.mark.parametrize("row, needle", [
    ([1, 2], "line 1 is a JSON list, not an object"),
    ({"prompt": "q", "chosen": "a"}, "has no key 'rejected'"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "'chosen' is int"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "the same response"),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "r"}]},
     "share 0 of 1 and 1"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "starts with a 'user' turn"),
    ({"prompt_ids": [1], "chosen_ids": [2]}, "has no key 'rejected_ids'"),
    ({"prompt_ids": [1], "chosen_ids": [2, -1], "rejected_ids": [3]}, "'chosen_ids' is '[2, -1]'"),
    ({"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [2]}, "are the same response"),
])
def test_bad_pairs_name_the_line_and_the_fix(tmp_path, row, needle):
    with pytest.raises(UserError, match="Fix:") as err:
        load_pairs(write(tmp_path, [row]), "data.train_path")
    assert needle in str(err.value) and "data.train_path" in str(err.value), str(err.value)


def test_missing_empty_and_foreign_files(tmp_path):
    for path, needle in ((tmp_path / "none.jsonl", "no such file"), (tmp_path / "pairs.csv", "suffix '.csv'"),
                         (tmp_path / "empty.jsonl", "holds no pairs")):
        path.write_text("") if path.name != "none.jsonl" else None
        with pytest.raises(UserError, match=needle):
            load_pairs(str(path))


def test_pairs_of_token_ids_are_taken_as_they_are_and_checked_against_the_vocabulary(tmp_path):
    """Pairs of a policy's own samples, as ids: prompt + response, no template, no EOS added; an id past the
    model's embedding rows is refused by name."""
    from transformers import AutoTokenizer

    from helpers import REPO
    from megarl.rm.pairs import tokenize_pairs

    tok = AutoTokenizer.from_pretrained(REPO / "recipes/tiny/model")
    pairs = load_pairs(write(tmp_path, [{"prompt_ids": [10, 4], "chosen_ids": [4, 1], "rejected_ids": [5, 1]}]))
    (got,), dropped = tokenize_pairs(pairs, tok, False, True, 16, False, 18, "data.train_path")
    assert (got.chosen, got.rejected, dropped) == ([10, 4, 4, 1], [10, 4, 5, 1], 0)
    far = load_pairs(write(tmp_path, [{"prompt_ids": [10], "chosen_ids": [18], "rejected_ids": [5]}]))
    with pytest.raises(UserError, match="token id 18 is past the model's 18 embedding rows"):
        tokenize_pairs(far, tok, False, True, 16, False, 18, "data.train_path")
    text = load_pairs(write(tmp_path, [{"prompt": "6 0", "chosen": "0", "rejected": "5"}]))
    (plain,), _ = tokenize_pairs(text, tok, False, True, 16, False, 18, "data.train_path")
    assert plain.chosen == tok("6 0")["input_ids"] + tok.encode("0", add_special_tokens=False) + [tok.eos_token_id]
