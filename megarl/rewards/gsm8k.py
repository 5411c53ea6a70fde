"""GSM8K verifier: 1.0 when the completion's final number equals the reference's, else 0.0.

Reward functions take the batch, `fn(completions: list[str], answers: list[str]) -> list[float]`,
so a verifier can amortise setup over many samples.
"""

from __future__ import annotations

import math
import re
import threading
from decimal import Decimal
from fractions import Fraction

import sympy
from math_verify import parse as _math_verify_parse

# "1,234.5", "-3", ".5", "$18", "$-4", "\$18" (LaTeX's escaped dollar), "−4" (Unicode minus); a comma must sit
# between digits, so "18," stops at "18". The digits are atomic: a pattern that fails after them (a heading's
# "18. She") must fail whole rather than backtrack to a shorter number ("1").
_NUMBER = r"(?:\\?\$[-−]|[-−]?(?:\\?\$)?)(?>\d(?:,?\d)*(?:\.\d+)?|\.\d+)"
# The number right after "####", allowing spaces, markdown bold ("#### **18**"), a leading "+", "~" or "≈" and
# parentheses ("#### (18)"), unless it numbers a markdown heading ("#### 3. Add them", "#### 2) Subtract",
# "#### (3) Add them"): that is a step title, not the answer; nor when an operator and a number follow it
# ("#### 15 + 3 = 18", "#### 7/2", "#### 1e3"): the first number is not the answer ("#### 7/2" was paid as 7), and
# that line goes to math-verify, which reads an equation's right side and a fraction whole. Not arithmetic: a unit
# ("#### $18/day") and an answer followed by its working ("#### 18 = 6 * 3").
_LEAD = r"^[\s*]*(?:[+~≈][ \t]*)?(?P<open>\()?[ \t]*"
_ARITHMETIC = r"[ \t]*[-+*/×÷^][ \t]*\(?[ \t]*[\d.$\\]|[eE][-+]?\d"
_HASH_ANSWER_RE = re.compile(
    rf"{_LEAD}(?P<number>{_NUMBER})(?!{_ARITHMETIC})"
    r"(?(open)[ \t]*\)(?![.]?[ \t]*[A-Za-z])|(?![.)][ \t]*[A-Za-z]))")
_HASH_ARITHMETIC_RE = re.compile(rf"{_LEAD}{_NUMBER}(?:{_ARITHMETIC})")
# An integer fraction as math-verify hands it back written: "8/2", or "\frac{8}{2}" (its LaTeX parser has already
# divided those, so the value alone cannot tell "4" from "8/2").
_FRACTION_RE = re.compile(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}|(?<![\d.])(-?\d+)\s*/\s*(-?\d+)(?![\d.])")
# A number math-verify found but could not parse for what is around it: "\boxed{723.}" (its LaTeX parser refuses the
# "."), "the answer is **18**" (markdown bold, which the "####" path allows too).
_WRITTEN_NUMBER_RE = re.compile(rf"[\s*]*({_NUMBER})[\s*]*\.?[\s*]*")
_CLEAN = str.maketrans({"\\": None, "$": None, ",": None, "−": "-"})
# LaTeX's spacing between thousands ("1\,234", "12\ 345\,678", "1~234"): math-verify's parser reads the two sides as
# a product or a sum ("\boxed{1\,234}" was 235), so it goes before the text reaches it.
_LATEX_THOUSANDS_RE = re.compile(r"(?<=\d)(?:\\[,;:! ]|~)(?=\d{3}(?!\d))")
# Scientific notation ("1e3", "2.5E-3"): math-verify reads the mantissa alone ("#### 1e3" was paid as 1), so it is
# written out first; an exponent past 100 is no GSM8K answer, and is left unreadable rather than read as its mantissa.
_SCIENTIFIC_RE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?!\w|\.\d)")


def _clean(number: str) -> str:
    return number.translate(_CLEAN)


def _math_verify_number(text: str) -> str | None:
    """The number math-verify extracts (it prefers \\boxed{} and "answer is" anchors), or None."""
    # math-verify's timeout uses SIGALRM, which Python only allows in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    # "first_match": only the match math-verify ranks first (the last \boxed{}, the last "answer is"); when that
    # does not parse ("\boxed{723.}"), the default went on to an earlier number ("We had 20."). It also makes the
    # string it returns the one that value was parsed from.
    text = _SCIENTIFIC_RE.sub(_positional, _LATEX_THOUSANDS_RE.sub("", text))
    found = _math_verify_parse(text, parsing_timeout=timeout, extraction_mode="first_match")
    written = next((item for item in found if isinstance(item, str)), "")
    if _division_left_undone(written):
        return None
    parsed = [item for item in found if isinstance(item, sympy.Basic)]
    if not parsed:
        plain = _WRITTEN_NUMBER_RE.fullmatch(written)
        return _clean(plain.group(1)) if plain else None
    for item in parsed:
        if _is_percent(item):
            item = item.args[0]  # "40%": GSM8K writes a percentage as the number, "#### 40"
        if item.is_number and _written_number(item):
            value = item.doit()  # "1/2" parses as an unevaluated product
            if isinstance(value, sympy.Rational | sympy.Float):
                return str(value)
    return None


def _positional(match: re.Match[str]) -> str:
    exponent = int(match.group(2))
    return format(Decimal(match.group(1)).scaleb(exponent), "f") if abs(exponent) <= 100 else "?"


def _division_left_undone(written: str) -> bool:
    """Whether ``written`` holds a fraction that is not in lowest terms with a denominator above 1 ("8/2",
    "-8/-2", "\\frac{12}{3}"): paying it as 4 would pay a response for leaving the division to the verifier."""
    for match in _FRACTION_RE.finditer(written):
        p, q = (int(g) for g in match.groups() if g is not None)
        if q <= 1 or math.gcd(p, q) != 1:
            return True
    return False


def _is_percent(item: sympy.Basic) -> bool:
    """math-verify writes "40%" as 40 times an unevaluated 1/100."""
    return (isinstance(item, sympy.Mul) and len(item.args) == 2 and isinstance(item.args[1], sympy.UnevaluatedExpr)
            and item.args[1].args[0] == sympy.Rational(1, 100))


def _written_number(item: sympy.Basic) -> bool:
    """Whether ``item`` is a number as written (an integer, a decimal, a signed fraction p/q, which
    _division_left_undone holds to lowest terms), not arithmetic left to do: math-verify parses "the result is
    740 * 101" and "2 + 3" as expressions, and evaluating them would pay a response for restating the question."""
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

    From the last "####" (GSM8K's own format): (1) the number right after it, unless that numbers a heading or
    arithmetic follows it; else (2) the number math-verify (a required dependency, so that scores never depend on
    what happens to be installed) parses from its line where arithmetic follows ("#### 15 + 3 = 18"), from the
    text after it otherwise. Only when that text has no digit at all ("####" left empty) does the search go back to
    the text before it, the same way; text without "####" goes to math-verify whole. A number written before the
    last "####" never stands in for one after it that cannot be read.
    """
    after, match, _ = _final_part(text)
    return _clean(match.group("number")) if match else _math_verify_number(after)


def _final_part(text: str) -> tuple[str, re.Match[str] | None, bool]:
    """(the text extract_answer reads the answer from, the number right after its "####" or None, whether that text
    is the equation or fraction that starts right after a "####"). Where arithmetic follows the "####", the text is
    that line alone: what comes after it ("Let me know if you have 2 more questions") is not the answer."""
    while True:
        text, hashes, after = text.rpartition("####")
        if not hashes:
            return after, None, False
        after = _LATEX_THOUSANDS_RE.sub("", after)  # "#### 1\,234" is 1234, not 1
        match = _HASH_ANSWER_RE.match(after)
        if match is None and _HASH_ARITHMETIC_RE.match(after):
            return after.lstrip().split("\n", 1)[0], None, True
        if match or re.search(r"\d", after):
            return after, match, False


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
    """0.1 per completion that ends its reasoning GSM8K-style with "#### <number>", else 0.0: where
    ``extract_answer`` reads the answer right after a "####" ("#### (5)", "#### ~5", "#### 1/2"; not a heading's
    "#### 3. Add").

    `answers` is unused; it is there so this has the signature of every reward function.
    """
    return [0.1 if _hash_answer(c) else 0.0 for c in completions]


def _hash_answer(text: str) -> bool:
    """Whether ``extract_answer`` reads the answer right after a "####": the number there, or the equation or
    fraction that starts there ("#### 1/2 cup")."""
    after, match, equation = _final_part(text)
    return match is not None or (equation and _math_verify_number(after) is not None)
