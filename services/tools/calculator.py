"""Arithmetic for the calculator tool: parsed and walked by simpleeval, never eval()'d.

Only numbers, + - * / // % ** and unary minus, parentheses, a few math functions and the
constants pi and e; anything else (names, attributes, strings, comparisons, calls to
anything not listed) is refused. simpleeval also caps exponents, so `9**9**9` is an error
rather than a frozen worker.
"""

from __future__ import annotations

import ast
import math
import operator

from simpleeval import SimpleEval, safe_mult, safe_power

MAX_EXPRESSION = 256
# What the JSON Schema lets through; the evaluator is the real guard.
EXPRESSION_PATTERN = r"^[0-9a-z+\-*/%^().,\s]+$"

FUNCTIONS = {
    "sqrt": math.sqrt,
    "log": math.log,
    "log10": math.log10,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "min": min,
    "max": max,
}
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: safe_mult,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: safe_power,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


class CalculationError(ValueError):
    """The expression is not arithmetic this calculator does, or has no finite value."""


def calculate(expression: str) -> float | int:
    """The value of `expression`; `^` is read as a power, as people write it."""
    evaluator = SimpleEval(
        operators=OPERATORS, functions=FUNCTIONS, names={"pi": math.pi, "e": math.e}
    )
    try:
        value = evaluator.eval(expression.replace("^", "**"))
    except ZeroDivisionError:
        raise CalculationError("division by zero") from None
    except (SyntaxError, ValueError, TypeError, OverflowError, ArithmeticError) as error:
        raise CalculationError(f"cannot calculate {expression!r}: {error}") from None
    except Exception as error:  # simpleeval's own refusals: unknown names, functions, ...
        raise CalculationError(f"not arithmetic: {error}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculationError(f"{expression!r} is not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculationError(f"{expression!r} has no finite value")
    return value
