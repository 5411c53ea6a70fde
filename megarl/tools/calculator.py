"""A calculator tool: arithmetic on numbers, evaluated by walking Python's ast, never by eval.

Only numbers, + - * / // % **, unary plus and minus and parentheses are accepted. Sizes are checked before
each operation, so `9**9**9` is refused at once instead of running for hours.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

_MAX_CHARS = 1000
_MAX_BITS = 4096
"""Largest integer result, in bits (about 1200 decimal digits)."""
_MAX_EXPONENT = 10_000

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _bits(x: float) -> int:
    return abs(x).bit_length() if isinstance(x, int) else 0


def _check_size(op: ast.operator, a: float, b: float) -> None:
    """Refuse an operation whose integer result would exceed _MAX_BITS, before computing it."""
    if isinstance(op, ast.Pow):
        if abs(b) > _MAX_EXPONENT:
            raise ValueError(f"exponent {b} is too large (at most {_MAX_EXPONENT} in size)")
        if isinstance(a, int) and isinstance(b, int) and b > 0 and _bits(a) * b > _MAX_BITS:
            raise ValueError(f"{a} ** {b} is too large (more than {_MAX_BITS} bits)")
    elif isinstance(op, ast.Mult) and _bits(a) + _bits(b) > _MAX_BITS:
        raise ValueError(f"the product is too large (more than {_MAX_BITS} bits)")


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        _check_size(node.op, a, b)
        try:
            result = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large for a float") from None
        if isinstance(result, complex):
            raise ValueError("the result is complex (a negative number to a fractional power)")
        return result
    raise ValueError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError saying why for anything else."""
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"the expression is too long ({len(expression)} characters, at most {_MAX_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as err:
        raise ValueError(f"not an arithmetic expression: {err}") from None
    try:
        return _eval(tree)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def _show(x: float) -> str:
    if isinstance(x, float) and math.isfinite(x) and x.is_integer() and abs(x) < 2**53:
        return str(int(x))
    return repr(x)


class Calculator:
    """Evaluates one arithmetic expression per call; refusals raise ValueError (the pool shows "error: ...")."""

    name = "calculator"
    description = (
        "Evaluates an arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. (17 + 5) * 3 / 2. "
        "No variables or functions."
    )

    def run(self, call: str) -> str:
        return _show(calculate(call))
