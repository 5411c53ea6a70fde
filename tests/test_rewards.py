"""GSM8K verifier on real GSM8K answers, and reward lookup by import path."""

from __future__ import annotations

import json
import math
import sys
import threading
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from megarl.config import build_config
from megarl.errors import UserError
from megarl.rewards import gsm8k
from megarl.rewards.gsm8k import extract_answer, format_reward, reward
from megarl.rewards.registry import load_reward
from megarl.rewards.scorer import RewardScorer

TEST_JSONL = Path(gsm8k.__file__).resolve().parent.parent / "data" / "gsm8k" / "test.jsonl"


def gsm8k_rows(n: int) -> list[dict[str, str]]:
    with TEST_JSONL.open() as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_extract_answer_from_real_gsm8k_solutions() -> None:
    # The first test problems: Janet's ducks (18), the robe (3), house flipping (70000), sprints (540), chickens (20).
    assert [extract_answer(row["answer"]) for row in gsm8k_rows(5)] == ["18", "3", "70000", "540", "20"]


def test_reward_on_real_gsm8k_answers() -> None:
    answers = [row["answer"] for row in gsm8k_rows(5)]
    completions = [
        "She sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = $18.\n#### 18",  # right
        "It takes 2 + 1 = 3 bolts.\n#### 4",  # wrong after ####
        "Profit = 200,000 - 130,000.\n#### $70,000.00",  # right: $, comma and trailing zeros
        "He runs 3 * 3 * 60 = 540 meters a week.",  # right: no ####, the final number
        "",  # nothing to compare
    ]
    assert reward(completions, answers) == [1.0, 0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("written", ["1,000", "1000", "1000.00", "$1,000", "#### 1000.0", "**1,000**"])
def test_numeric_comparison_ignores_commas_dollars_trailing_zeros(written: str) -> None:
    assert reward([f"#### {written}"], ["#### 1,000"]) == [1.0]
    assert reward([f"#### {written}"], ["1000"]) == [1.0]


def test_strict_hash_answer_wins_over_later_numbers() -> None:
    # The last "####" decides, even with other numbers around it.
    assert extract_answer("#### 5 first try\n#### 7 (because 3 + 4 = 7) 12") == "7"
    assert extract_answer("-3 degrees\n#### -3") == "-3"


@pytest.mark.parametrize(("text", "expected"), [
    ("answer: 18 (since 20-2)", "18"),  # the last-number rule said -2
    ("#### 3. Add them\n5 + 13 = 18, so the answer is 18", "18"),  # a numbered heading is not the answer
    ("#### 2) Subtract\n#### 16", "16"),
    ("#### 18.", "18"),
    (r"The answer is \boxed{3}, found after 4 steps.", "3"),
    ("#### none, so 12", "12"),
    ("no digits", None),
])
def test_answers_that_a_last_number_rule_gets_wrong(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_boxed_fractions_compare_numerically() -> None:
    assert reward([r"so \boxed{\frac{1}{2}}"], ["0.5"]) == [1.0]


def test_reward_works_outside_the_main_thread() -> None:
    # math-verify's timeout uses SIGALRM, which only the main thread may set.
    out: list[list[float]] = []
    worker = threading.Thread(target=lambda: out.append(reward([r"\boxed{18}"], ["#### 18"])))
    worker.start()
    worker.join()
    assert out == [[1.0]]


def test_format_reward() -> None:
    assert format_reward(["x\n#### 18", "#### $1,000", "the answer is 18", "#### eighteen", "#### \\$18", "#### −4"],
                         [""] * 6) == [0.1, 0.1, 0.0, 0.0, 0.1, 0.1]


def test_the_format_bonus_goes_where_the_reward_reads_a_number_after_the_last_hashes() -> None:
    """The format reward read any "####" and a number, where the reward reads the last "####": a step's heading
    ("#### 3. Add") got the bonus, and "#### (5)" or "#### ~5", which the reward reads, did not."""
    texts = ["#### (5)", "#### ~5", "####\n5", "#### 3. Add them", "#### -", "#### 4\n#### x", "#### 7 + 1 = 8",
             "#### 1/2 cup", "#### 18 = 6 * 3", "#### 2 * 3 + y", "#### 1/2\n####"]
    assert format_reward(texts, [""] * len(texts)) == [0.1, 0.1, 0.1, 0.0, 0.0, 0.1, 0.1, 0.1, 0.1, 0.0, 0.1]
    assert extract_answer("#### 1/2\n####") == "1/2"  # an empty last "####": the one before is read, and paid


def test_load_reward_by_import_path() -> None:
    assert load_reward("megarl.rewards.gsm8k:reward").__wrapped__ is reward  # type: ignore[attr-defined]
    assert load_reward("megarl.rewards.gsm8k:format_reward").__wrapped__ is format_reward  # type: ignore[attr-defined]
    assert load_reward("megarl.rewards.gsm8k:reward")(["#### 18"], ["18"]) == [1.0]


def test_a_reward_that_raises_is_one_paragraph_naming_its_field(tmp_path, monkeypatch) -> None:
    """An eval set's reward failing on some samples: a paragraph naming eval.datasets[0].reward, not a traceback."""
    (tmp_path / "picky.py").write_text("def reward(completions, answers):\n"
                                       "    return [float(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from megarl.eval.in_training import load_eval_sets

    cfg = build_config({"model": {"hf_path": "m"}, "data": {"train_path": "gsm8k", "apply_chat_template": False},
                        "eval": {"every": 1, "datasets": [{"name": "echo", "path": "recipes/tiny/echo.jsonl",
                                                           "reward": "picky:reward", "max_prompts": 2}]}})
    [eval_set] = load_eval_sets(cfg, AutoTokenizer.from_pretrained("recipes/tiny/model"), ())
    assert eval_set.reward_fn(["1", "2"], ["", ""]) == [1.0, 2.0]
    with pytest.raises(UserError) as info:
        eval_set.reward_fn(["1", "two"], ["", ""])
    message = str(info.value)
    assert message.startswith("eval.datasets[0].reward = 'picky:reward' raised ValueError: could not convert")
    assert "Fix:" in message and "\n" not in message


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("no_colon_here", "import path"),
        ("megarl_no_such_module:fn", "no module named 'megarl_no_such_module'"),
        ("megarl.rewards.no_such:fn", "no module named 'megarl.rewards.no_such'"),
        ("megarl.rewards.gsm8k:nope", "has no attribute 'nope'"),
        ("megarl.rewards.gsm8k:_NUMBER", "is a str, not a function"),
    ],
)
def test_load_reward_errors_name_the_field(spec: str, expected: str) -> None:
    with pytest.raises(UserError, match="trainer.reward") as err:
        load_reward(spec)
    assert expected in str(err.value) and repr(spec) in str(err.value)


def test_load_reward_reports_broken_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "needs_dep.py").write_text("import megarl_missing_dependency\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="needs 'megarl_missing_dependency'"):
        load_reward("needs_dep:fn")
    with pytest.raises(UserError, match="RuntimeError: boom"):
        load_reward("raises:fn")


@pytest.mark.parametrize("text, value, scores", [
    ("the result is 740 * 101.", "74740", False), ("so x = 2 + 3", "5", False), ("The answer is 12 - 4", "8", False),
    ("so 1/2", "1/2", True), ("The answer is -7/4", "-7/4", True), ("it is 3.5", "3.5", True),
    (r"\boxed{\frac{1}{2}}", "1/2", True)])
def test_arithmetic_left_to_do_is_no_answer(text: str, value: str, scores: bool) -> None:
    """Restating the question's expression ("740 * 101") must not score: math-verify parses it, and evaluating it
    paid 4% of SmolLM2's answers on three-digit products that computed nothing."""
    got = extract_answer(text)
    assert (got is not None and Fraction(got) == Fraction(value)) if scores else got is None
    assert reward([text], [value]) == [float(scores)]


@pytest.mark.parametrize(("text", "reads", "answer", "score"), [
    # A numbered heading after "####" is skipped whole, never read as a shorter number (the old pattern backtracked
    # from "18" to "1"); the text after "####" then goes to math-verify.
    ("Janet sells 9 eggs at $2 each.\n#### 18. She makes $18 every day.", "18", "18", 1.0),
    ("#### $18. She makes $18 every day.", "18", "18", 1.0),
    ("#### 70,000. That is the profit.", "70000", "70000", 1.0),
    ("#### 3.5) Total", "3.5", "3.5", 1.0),
    ("#### 1.5. Add", "1.5", "1.5", 1.0),
    ("#### 12. Then", "12", "1", 0.0),  # read "1", paying answer 1
    ("#### 10. Final step\nso the answer is 42", "42", "1", 0.0),
    ("#### 10. Final step\nso the answer is 42", "42", "42", 1.0),
    ("#### (3) Add them\nso 18", "18", "18", 1.0),
    # Answer formats after "####" that fell through to an earlier number ("20"), or to none.
    ("She earns 20 dollars. #### \\$18", "18", "18", 1.0),
    ("We get 20.\n#### \\$18.00", "18", "18", 1.0),
    ("I had 20.\n#### (18)", "18", "18", 1.0),
    ("I had 20.\n#### +18", "18", "18", 1.0),
    ("I had 20.\n#### ~18", "18", "18", 1.0),
    ("I had 20.\n#### ≈18", "18", "18", 1.0),
    ("#### −4", "-4", "-4", 1.0),  # U+2212
    ("#### $−4", "-4", "-4", 1.0),
    # What follows the last "####" is unreadable: no number from before it stands in.
    ("She had 20 eggs.\n#### \\frac{36}{2}", None, "20", 0.0),
    # Kept: a "####" with no digit after it looks back; what follows a number is not read.
    ("The answer: 4\n####\n", "4", "4", 1.0),
    ("#### 4\n#### x", "4", "4", 1.0),
    ("#### 4 apples", "4", "4", 1.0),
    ("#### 2+2", None, "2", 0.0),  # arithmetic after the number: math-verify's, which leaves it undone
    # An equation or a fraction after "####" is read whole, not as its first number (which was paid: 7 for "7/2").
    ("#### 15 + 3 = 18", "18", "18", 1.0),
    ("#### 15 + 3 = 18", "18", "15", 0.0),
    ("#### 2 * 9 = 18", "18", "2", 0.0),
    ("#### $15 + $3 = $18", "18", "18", 1.0),
    ("#### 7/2", "7/2", "7", 0.0),
    ("#### 1/2", "1/2", "0.5", 1.0),
    ("#### 18 - 2 = 16", "16", "16", 1.0),
    ("#### $18/day", "18", "18", 1.0),  # a unit, not a division
    ("#### 18 = 6 * 3", "18", "18", 1.0),  # the answer, then its working
    ("#### 18=6*3", "18", "18", 1.0),
    ("#### 0.2 = 20%", "0.2", "0.2", 1.0),
    # The equation's line alone: what follows it is not the answer.
    ("#### 15 + 3 = 18\n\nI hope this helps! Let me know if you have 2 more questions.", "18", "18", 1.0),
    ("#### 15 + 3 = 18\nStep 4: 7", "18", "7", 0.0),
    ("#### 7/2\nThat is 3.5 pies.", "7/2", "3.5", 1.0),
    ("#### 7/2\nThat is 3 pies.", "7/2", "3", 0.0),
    # Markdown bold around an answer math-verify finds without "####".
    ("The answer is **18**", "18", "18", 1.0),
    ("$18 per day.\n\n**Final Answer:** **18**", "18", "18", 1.0),
    ("#### 4 or 5", "4", "5", 0.0),
    ("#### 44", "44", "4", 0.0),
    ("964 * 494", None, "476216", 0.0),
    # Division left undone is no answer; a fraction in lowest terms is one.
    ("so 8/2", None, "4", 0.0),
    ("\\boxed{-8/-2}", None, "4", 0.0),
    ("so 12/3", None, "4", 0.0),
    ("\\boxed{\\frac{12}{3}}", None, "4", 0.0),
    ("\\boxed{4/1}", None, "4", 0.0),
    ("so 7/-4", None, "-7/4", 0.0),
    ("so 7/4", "7/4", "1.75", 1.0),
    ("\\boxed{-\\frac{7}{4}}", "-7/4", "-1.75", 1.0),
    # A percentage reads as its number, as "#### 40%" does; math-verify's LaTeX parser refuses "723.".
    ("40%", "40", "40", 1.0),
    ("\\boxed{40\\%}", "40", "40", 1.0),
    ("\\boxed{723.}", "723", "723", 1.0),
    ("We had 20. \\boxed{723.}", "723", "20", 0.0),  # math-verify went on to an earlier number
    # LaTeX's thousands spacing: math-verify read "1\\,234" as 1 + 234.
    ("\\boxed{1\\,234}", "1234", "1234", 1.0),
    ("\\boxed{1\\,234}", "1234", "235", 0.0),
    ("The total is 12\\ 345\\,678.", "12345678", "12345678", 1.0),
    ("\\boxed{1~234}", "1234", "1234", 1.0),
    # Scientific notation: math-verify read the mantissa alone ("#### 1e3" was paid as 1).
    ("#### 1e3", "1000", "1000", 1.0),
    ("#### 1e3", "1000", "1", 0.0),
    ("#### 1.5e2", "150", "1.5", 0.0),
    ("The answer is 2.5E-3", "0.0025", "0.0025", 1.0),
    ("#### 1e999", None, "1", 0.0),
    ("The answer is 1e3.", "1000", "1000", 1.0),
    ("#### 1\\,234", "1234", "1234", 1.0),
])
def test_the_answer_is_read_whole_and_from_after_the_last_hashes(text: str, reads: str | None, answer: str,
                                                                  score: float) -> None:
    got = extract_answer(text)
    assert (got is not None and Fraction(got) == Fraction(reads)) if reads is not None else got is None, got
    assert reward([text], [answer]) == [score]

def test_reward_workers_score_as_the_training_process_does() -> None:
    """trainer.reward_workers: a batch split among worker processes, and a group submitted while the caller goes
    on, score exactly as the function called in this process."""
    texts = ["#### 18", "the answer is 7", "#### **3**", "no number", "\\boxed{1/2}", "#### 1,000"] * 3
    answers = ["18", "7", "4", "1", "0.5", "1000"] * 3
    inline = load_reward("megarl.rewards.gsm8k:reward")(texts, answers)
    scorer = RewardScorer("megarl.rewards.gsm8k:reward", 2)
    try:
        assert scorer(texts, answers) == inline
        early = scorer.submit(texts[:6], answers[:6])
        assert scorer.result(early) == inline[:6]
    finally:
        scorer.close()


def test_a_reward_failing_in_a_worker_is_the_paragraph_naming_trainer_reward(tmp_path, monkeypatch) -> None:
    (tmp_path / "picky_w.py").write_text("import os\n"
                                         "def reward(completions, answers):\n"
                                         "    if 'die' in completions:\n"
                                         "        os._exit(3)\n"
                                         "    return [float(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned worker starts with this process's sys.path
    scorer = RewardScorer("picky_w:reward", 1)
    try:
        assert scorer(["1", "2"], ["", ""]) == [1.0, 2.0]
        with pytest.raises(UserError, match=r"^trainer.reward = 'picky_w:reward' raised ValueError: could not"):
            scorer.result(scorer.submit(["1", "two"], ["", ""]))
        with pytest.raises(UserError, match=r"^a reward worker process died \(exit code 3\) while scoring samples "
                                            r"again that a worker's death had lost before \(trainer.reward_workers "
                                            r"= 1, trainer.reward = 'picky_w:reward'\).*checkpoint.resume: auto"):
            scorer(["die"], [""])  # dies again in the fresh pool
    finally:
        scorer.close()


def test_a_reward_worker_killed_mid_step_costs_a_fresh_pool_and_the_samples_scored_again(tmp_path, monkeypatch,
                                                                                          capsys) -> None:
    """A user's reward can die of its own memory use (the OOM killer's SIGKILL): the run goes on, with one line,
    whether the death breaks samples being scored or comes between two calls (the next submit found the pool
    broken: the issue's traceback)."""
    import os
    import signal
    import time

    (tmp_path / "slow_w.py").write_text("import os, time\n"
                                        "def reward(completions, answers):\n"
                                        "    open(os.path.join(os.environ['MARKS'], str(os.getpid())), 'w').close()\n"
                                        "    time.sleep(0.5)\n"
                                        "    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("MARKS", str(marks))
    scorer = RewardScorer("slow_w:reward", 2)
    try:
        parts = [scorer.submit(["a"], [""]), scorer.submit(["bb"], [""])]
        while not list(marks.iterdir()):
            time.sleep(0.02)
        scoring = int(next(marks.iterdir()).name)
        assert scoring in scorer._pool._processes  # a worker of the pool, inside the reward
        os.kill(scoring, signal.SIGKILL)
        assert [scorer.result(part) for part in parts] == [[1.0], [2.0]]
        lines = [x for x in capsys.readouterr().out.splitlines() if "reward worker" in x]
        assert len(lines) == 1 and lines[0].startswith("megarl: a reward worker process died (killed by SIGKILL); "
                                                       "scoring its ")
        idle = next(iter(scorer._pool._processes))
        os.kill(idle, signal.SIGKILL)
        time.sleep(0.5)  # the pool sees it die between calls
        assert scorer(["ccc", "dddd"], ["", ""]) == [3.0, 4.0]
        assert "megarl: a reward worker process died (killed by SIGKILL)" in capsys.readouterr().out
    finally:
        scorer.close()


def test_no_reward_scores_zero_in_this_process() -> None:
    scorer = RewardScorer(None, 0)
    assert scorer(["a", "b"], ["", ""]) == [0.0, 0.0] and scorer.workers == 0
    assert scorer.result(scorer.submit(["a"], [""])) == [0.0]


def test_reward_workers_do_not_outlive_a_killed_training_process(tmp_path) -> None:
    """SIGKILL reaches the training process alone (the OOM killer, a user's kill -9): its workers exit too."""
    import subprocess
    import sys
    import time

    psutil = pytest.importorskip("psutil")
    script = tmp_path / "trainer.py"
    script.write_text("import time\nfrom megarl.rewards.scorer import RewardScorer\n"
                      "if __name__ == '__main__':\n"
                      "    s = RewardScorer('megarl.rewards.echo:reward', 2)\n"
                      "    print(s(['a', 'b'], ['a', 'c']), flush=True)\n"
                      "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "[1.0, 0.0]"
    workers = psutil.Process(proc.pid).children()
    assert len(workers) >= 2  # the two workers (and multiprocessing's resource tracker)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE
                                              for w in workers):
        time.sleep(0.2)
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)


def test_ranks_score_disjoint_shares_and_all_train_on_every_score(monkeypatch) -> None:
    """Two ranks (threads here, their all-gather a barrier): in the sync loop each scores every other sample, with
    async_rl every other group (by admission order), and both return every score, as one rank scoring all would."""
    from types import SimpleNamespace

    from helpers import threads_as_ranks
    from megarl.loop.rollout_manager import RolloutManager
    from megarl.loop.timing import PartTimes
    from megarl.rollout.base import Completion
    from megarl.rollout.inflight import Group, Partial

    calls: list[tuple[int, list[str]]] = []
    scorer = RewardScorer("megarl.rewards.echo:reward", 0)
    monkeypatch.setattr("torch.distributed.all_gather_object", threads_as_ranks(2))

    def manager(rank: int, world: int) -> RolloutManager:
        m = RolloutManager.__new__(RolloutManager)
        m.cfg = SimpleNamespace(trainer=SimpleNamespace(reward="megarl.rewards.echo:reward"))
        m.groups = SimpleNamespace(rank=rank, dims=SimpleNamespace(world_size=world))
        m.times, m._early, m._host_group = PartTimes(), {}, None
        m.decode = lambda tokens: " ".join(map(str, tokens))
        m.scorer = _Counting(scorer, rank, calls)
        m.partial = SimpleNamespace(pool=SimpleNamespace(groups=[]))
        return m

    rows = [Completion(prompt_index=i // 2, token_ids=[i % 3, 7], logprobs=[-0.1, -0.2], finish_reason="stop")
            for i in range(10)]
    answers = [str(i % 3) for i in range(5)]
    groups = [Group(uid=u, prompt=[1, 2], answer=str(u % 3), admitted=0,
                    samples=[Partial(seed=None, tokens=[(u + j) % 3, 5], logprobs=[-0.3, -0.4], versions=[0, 0],
                                     done=True) for j in range(2)]) for u in range(5)]
    one = manager(0, 1)
    one._score_early(groups[:3])  # three groups scored as they finished, two restored by a resume
    alone = (one._score_shares(rows, answers), one._scored(groups, step=0).scores.tolist())
    calls.clear()
    results: list[object] = [None, None]

    def rank(r: int) -> None:
        m = manager(r, 2)
        m._score_early(groups[:3])
        results[r] = (m._score_shares(rows, answers), m._scored(groups, step=0).scores.tolist())

    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results[0] == results[1] == alone
    assert sorted(text for _, texts in calls for text in texts) == sorted(
        [" ".join(map(str, c.token_ids)) for c in rows] + [" ".join(map(str, s.tokens)) for g in groups
                                                           for s in g.samples])  # each sample scored once
    assert {r for r, _ in calls} == {0, 1}


class _Counting:
    """A RewardScorer that records which rank scored which completions."""

    def __init__(self, scorer: RewardScorer, rank: int, calls: list) -> None:
        self.scorer, self.rank, self.calls = scorer, rank, calls

    def __call__(self, completions: list[str], answers: list[str]) -> list[float]:
        self.calls.append((self.rank, list(completions)))
        return self.scorer(completions, answers)

    def submit(self, completions: list[str], answers: list[str]):
        self.calls.append((self.rank, list(completions)))
        return self.scorer.submit(completions, answers)

    def result(self, part):
        return self.scorer.result(part)


def test_an_error_with_reward_workers_ends_with_its_paragraph_alone(tmp_path) -> None:
    """A reward that raises in a worker: the paragraph and exit code 2, then nothing (the pool, still referenced by
    the trainer's objects at exit, printed "Exception ignored ... weakref_cb" as the interpreter tore it down)."""
    import os
    import subprocess
    import sys

    (tmp_path / "raising_w.py").write_text("def reward(completions, answers):\n    raise KeyError('answer')\n")
    script = tmp_path / "trainer.py"
    script.write_text("import torch\n"  # as in training: without it, the interpreter tore things down in an order
                      "from megarl.rewards.scorer import RewardScorer\n"  # that hid the noise
                      "from megarl.run.command import run_main\n"
                      "kept = []\n"
                      "def main():\n"
                      "    kept.append(RewardScorer('raising_w:reward', 2))\n"
                      "    kept[0](['a', 'b', 'c'], ['', '', ''])\n"
                      "if __name__ == '__main__':\n"
                      "    run_main(main)\n")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=root, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{root}"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "megarl error: trainer.reward = 'raising_w:reward' raised KeyError: 'answer' (scoring 2 completions). Fix: "
        "make it return a score for every completion, e.g. 0.0 for one it cannot parse; MEGARL_DEBUG=1 shows the "
        "traceback."]


def test_a_reward_says_whether_it_reads_the_tool_turns(tmp_path, monkeypatch) -> None:
    """reads_tool_turns survives load_reward's wrapper for a function and for a callable object whose class sets
    it (functools.wraps copies an instance's attributes only); unset, a reward reads the policy's text."""
    (tmp_path / "verifiers.py").write_text(
        "class Seen:\n    reads_tool_turns = True\n    def __call__(self, completions, answers):\n"
        "        return [0.0] * len(completions)\n\n"
        "seen = Seen()\n\n"
        "def checks(completions, answers):\n    return [0.0] * len(completions)\n\n"
        "checks.reads_tool_turns = True\n\n"
        "def plain(completions, answers):\n    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from megarl.rewards.registry import load_reward
    from megarl.rewards.text import reads_tool_turns

    assert [reads_tool_turns(load_reward(f"verifiers:{name}")) for name in ("seen", "checks", "plain")] == \
        [True, True, False]


BAD_RETURNS = [
    (None, "returned None for 4 completions"),
    ({"a": 1.0}, "returned {'a': 1.0} (a dict) for 4 completions"),
    ([1.0, 0.0, 1.0], "returned a list of 3 for 4 completions"),
    ([None, 1.0, 0.0, 0.0], "returned None for sample 0 of the 4 completions it scored"),
    ([1.0, "abc", 0.0, 0.0], "returned 'abc' (a str) for sample 1 of the 4"),
    (["1.0", 1.0, 0.0, 0.0], "returned '1.0' (a str) for sample 0 of the 4"),
    ([1.0, 0.0, math.nan, 0.0], "returned nan for sample 2 of the 4"),
    ([1.0, 0.0, 0.0, np.float32("-inf")], "returned -inf for sample 3 of the 4"),
    (np.array(0.5), "returned array(0.5) (a ndarray) for 4 completions"),  # its len() raises
]


@pytest.mark.parametrize(("returned", "expected"), BAD_RETURNS)
def test_a_reward_returning_no_score_per_completion_is_one_paragraph(returned, expected, tmp_path,
                                                                      monkeypatch) -> None:
    """trainer.reward's return is checked where it is called (a rank's or a worker's share), naming the spec, what
    came back and the fix: a None or a string failed later as a traceback, a NaN trained silently."""
    (tmp_path / "shaped.py").write_text("RETURNED = None\ndef reward(completions, answers):\n    return RETURNED\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = RewardScorer("shaped:reward", 0)
    monkeypatch.setattr(sys.modules["shaped"], "RETURNED", returned)
    with pytest.raises(UserError) as info:
        scorer(["a", "b", "c", "d"], [""] * 4)
    message = str(info.value)
    assert message.startswith(f"trainer.reward = 'shaped:reward' {expected}"), message
    assert message.endswith("Fix: return one finite float (or int/bool) per completion, in the completions' order.")


def test_bools_ints_and_numpy_numbers_are_scores(tmp_path, monkeypatch) -> None:
    (tmp_path / "mixed.py").write_text("import numpy as np, torch\ndef reward(completions, answers):\n"
                                       "    return [True, 0, np.float32(0.5), np.float64(0.25)]\n"
                                       "def tensor(completions, answers):\n"
                                       "    return torch.tensor([0.5, 1.0])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    scores = load_reward("mixed:reward")(["a", "b", "c", "d"], [""] * 4)
    assert scores == [1.0, 0.0, 0.5, 0.25] and all(type(s) is float for s in scores)
    assert load_reward("mixed:tensor")(["a", "b"], ["", ""]) == [0.5, 1.0]  # a reward model's scores, as a tensor
