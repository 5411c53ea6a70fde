"""GSM8K verifier: 1.0 when the completion's final number equals the reference's, else 0.0.

Reward functions take the batch, `fn(completions: list[str], answers: list[str]) -> list[float]`,
so a verifier can amortise setup over many samples.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

import sympy
from math_verify import parse as _math_verify_parse

# "1,234.5", "-3", ".5", "$18"; a comma must sit between digits, so "18," stops at "18".
_NUMBER = r"-?\$?(?:\d(?:,?\d)*(?:\.\d+)?|\.\d+)"
# The number right after "####", allowing spaces and markdown bold ("#### **18**"), unless it numbers a
# markdown heading ("#### 3. Add them", "#### 2) Subtract"): that is a step title, not the answer.
_HASH_ANSWER_RE = re.compile(rf"^[\s*]*({_NUMBER})(?![.)][ \t]*[A-Za-z])")
_FORMAT_RE = re.compile(rf"####[\s*]*{_NUMBER}")


def _clean(number: str) -> str:
    return number.replace("$", "").replace(",", "")


def _math_verify_number(text: str) -> str | None:
    """The number math-verify extracts (it prefers \\boxed{} and "answer is" anchors), or None."""
    # math-verify's timeout uses SIGALRM, which Python only allows in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    for item in _math_verify_parse(text, parsing_timeout=timeout):
        if isinstance(item, sympy.Basic) and item.is_number and _written_number(item):
            value = item.doit()  # "1/2" parses as an unevaluated product
            if isinstance(value, sympy.Rational | sympy.Float):
                return str(value)
    return None


def _written_number(item: sympy.Basic) -> bool:
    """Whether ``item`` is a number as written (an integer, a decimal, a signed fraction p/q), not arithmetic left
    to do: math-verify parses "the result is 740 * 101" and "2 + 3" as expressions, and evaluating them would pay a
    response for restating the question."""
    if item.is_Number:
        return True
    if not isinstance(item, sympy.Mul):
        return False
    numbers = [a for a in item.args if a.is_Number]
    divisors = [a for a in item.args if isinstance(a, sympy.Pow) and a.exp == -1 and a.base.is_Integer]
    if len(numbers) + len(divisors) != len(item.args) or len(divisors) > 1:
        return False
    if len(numbers) == 2 and sympy.Integer(-1) in numbers:  # "-7/4" parses as -1 * 7 * 4^-1
        numbers.remove(sympy.Integer(-1))
    return len(numbers) == 1 and (bool(divisors) or numbers[0] == -1)


def extract_answer(text: str) -> str | None:
    """The final numeric answer in `text`, without "$" and thousands commas, or None.

    In order: (1) the number right after the last "####" (GSM8K's own format) that is not a numbered
    heading; (2) the number math-verify parses from the text (a required dependency, so that scores
    never depend on what happens to be installed).
    """
    for part in reversed(text.split("####")[1:]):
        match = _HASH_ANSWER_RE.match(part)
        if match:
            return _clean(match.group(1))
    return _math_verify_number(text)


def _value(answer: str | None) -> Fraction | None:
    if answer is None:
        return None
    try:
        return Fraction(answer)
    except (ValueError, ZeroDivisionError):
        return None


def reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the completion's answer equals the reference numerically ("1,000" == "1000.00"), else 0.0.

    `answers` may be GSM8K solutions ("... #### 18") or bare numbers; both go through extract_answer.
    """
    if len(completions) != len(answers):
        raise ValueError(f"gsm8k.reward: {len(completions)} completions but {len(answers)} answers")
    scores = []
    for completion, answer in zip(completions, answers, strict=True):
        expected = _value(extract_answer(answer))
        got = _value(extract_answer(completion))
        scores.append(1.0 if expected is not None and got == expected else 0.0)
    return scores


def format_reward(completions: list[str], answers: list[str]) -> list[float]:
    """0.1 per completion that ends its reasoning GSM8K-style with "#### <number>", else 0.0.

    `answers` is unused; it is there so this has the signature of every reward function.
    """
    return [0.1 if _FORMAT_RE.search(completion) else 0.0 for completion in completions]
