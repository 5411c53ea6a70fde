"""The prompts a reward model with its own tokenizer, or a judge, reads beside each sample: each sample gets its own
prompt's record, and a batch whose samples do not begin with their prompts' tokens is refused, never mispaired."""

import pytest

from megarl.data.batching import TokenizedPrompt
from megarl.data.prompts import PromptRecord
from megarl.errors import UserError
from megarl.loop.step_prompts import StepPrompts


def prompts(*specs: tuple[str, list[int]]) -> list[TokenizedPrompt]:
    return [TokenizedPrompt(record=PromptRecord(prompt=text, answer=text.upper()), tokens=ids) for text, ids in specs]


def test_each_sample_gets_its_prompts_record_over_the_calls_of_a_step():
    given = iter([prompts(("a", [1, 2])), prompts(("b", [3]), ("c", [4, 5, 6]))])
    kept = StepPrompts("reward_model", "the reward model cannot render their conversations again")
    take = kept.remembering(lambda: next(given))
    assert [p.record.prompt for p in take() + take()] == ["a", "b", "c"]
    sequences = [[1, 2, 9], [1, 2, 8, 7], [3, 9], [3], [4, 5, 6, 1], [4, 5, 6]]
    records = kept.records(sequences, [2, 2, 1, 1, 3, 3], n=2)
    assert [r.prompt for r in records] == ["a", "a", "b", "b", "c", "c"]
    kept.remembering(lambda: [])  # the next step starts empty
    assert kept.records([], [], n=2) == []


@pytest.mark.parametrize("sequences, lens", [
    ([[1, 2, 9], [1, 2, 8], [3, 9], [4, 5, 6, 1]], [2, 2, 1, 3]),  # a sample short for n=2 per prompt
    ([[3, 9], [3, 1], [1, 2, 9], [1, 2, 8], [4, 5, 6], [4, 5, 6]], [1, 1, 2, 2, 3, 3]),  # prompts swapped
    ([[1, 2, 9], [1, 2, 8], [3, 9], [3, 9], [4, 5, 7], [4, 5, 6]], [2, 2, 1, 1, 3, 3]),  # a prompt's token differs
])
def test_samples_out_of_their_prompts_order_are_refused_naming_the_section(sequences, lens):
    given = prompts(("a", [1, 2]), ("b", [3]), ("c", [4, 5, 6]))
    kept = StepPrompts("reward_model.judge", "the judge cannot read their text")
    kept.remembering(lambda: given)()
    with pytest.raises(UserError, match=r"^reward_model.judge: the step's samples are not in the order of its "
                                        r"prompts, so the judge cannot read their text\. This is a fault in megarl"):
        kept.records(sequences, lens, n=2)
