"""Arithmetic for the calculator tool and the agent's planner: parsed and walked by
simpleeval, never eval()'d.

Only numbers, + - * / // % ** and unary minus, parentheses, a few math functions and the
constants pi and e; anything else (attributes, strings, comparisons, keywords, names or
calls not listed) is refused before anything is evaluated. Powers and products are priced
before they run: one whose integer result would pass MAX_DIGITS digits is refused, so no
expression of at most MAX_EXPRESSION characters computes for more than milliseconds.
Callers on an event loop should still run `calculate` in a thread.
"""

from __future__ import annotations

import ast
import math
import operator

from simpleeval import SimpleEval

MAX_EXPRESSION = 256
# What the JSON Schema lets through; the evaluator is the real guard.
EXPRESSION_PATTERN = r"^[0-9a-z+\-*/%^().,\s]+$"
# Of an integer result; below Python's 4300-digit limit on int -> str, so every value can
# be reported exactly. MAX_BITS prices an operation before it runs, LIMIT checks the result.
MAX_DIGITS = 4000
LIMIT = 10**MAX_DIGITS
MAX_BITS = LIMIT.bit_length()


class CalculationError(ValueError):
    """The expression is not arithmetic this calculator does, or has no finite value."""


def _too_large() -> CalculationError:
    return CalculationError(f"the result would have more than {MAX_DIGITS} digits")


def power(base: float, exponent: float) -> float:
    """`base ** exponent`, refused before it runs if it would be an integer of more than
    MAX_BITS bits (about n * log2|base|; |base| >= 2 makes n itself a lower bound)."""
    grows = isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1
    if grows and (exponent > MAX_BITS or exponent * math.log2(abs(base)) > MAX_BITS):
        raise _too_large()
    value = base**exponent
    if isinstance(value, complex):
        raise CalculationError("a negative number to a fractional power has no real value")
    return value


def multiply(a: float, b: float) -> float:
    """`a * b`, refused before it runs if it would be an integer of more than MAX_BITS bits
    (it has at least bit_length(a) + bit_length(b) - 1)."""
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_BITS + 1:
        raise _too_large()
    return a * b


def rounded(number: float, ndigits: int | None = None) -> float:
    """round(), whose ndigits is bounded: round(5, -10**7) builds a 10-million-digit int."""
    if ndigits is None:
        return round(number)
    if not isinstance(ndigits, int) or abs(ndigits) > MAX_DIGITS:
        raise CalculationError(f"round's digits must be a whole number within ±{MAX_DIGITS}")
    return round(number, ndigits)


FUNCTIONS = {
    "sqrt": math.sqrt,
    "log": math.log,
    "log10": math.log10,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "abs": abs,
    "round": rounded,
    "floor": math.floor,
    "ceil": math.ceil,
    "min": min,
    "max": max,
}
NAMES = {"pi": math.pi, "e": math.e}
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: multiply,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: power,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
# Every other node (Attribute, Subscript, Compare, keyword, Starred, ...) is refused.
SHAPES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Load, *OPERATORS)


def parse(expression: str) -> ast.Expression:
    """The expression's tree, refused unless it is arithmetic of the allowed shapes."""
    if len(expression) > MAX_EXPRESSION:
        raise CalculationError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise CalculationError(f"cannot read {expression!r}: {error}") from None
    callees = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if node.keywords or not isinstance(node.func, ast.Name):
                raise CalculationError("only the listed functions, called with plain arguments")
        elif isinstance(node, ast.Name):
            known = FUNCTIONS if id(node) in callees else NAMES
            if node.id not in known:
                raise CalculationError(f"unknown name {node.id!r}")
        elif isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                raise CalculationError(f"{node.value!r} is not a number")
        elif not isinstance(node, SHAPES):
            raise CalculationError(f"not arithmetic: {type(node).__name__}")
    return tree


def calculate(expression: str) -> float | int:
    """The value of `expression`; `^` is read as a power, as people write it."""
    tree = parse(expression)
    evaluator = SimpleEval(operators=OPERATORS, functions=FUNCTIONS, names=NAMES)
    try:
        value = evaluator.eval(expression, previously_parsed=tree.body)
    except CalculationError:
        raise
    except ZeroDivisionError:
        raise CalculationError("division by zero") from None
    except RecursionError:
        raise CalculationError("the expression is nested too deeply") from None
    except (ValueError, TypeError, OverflowError, ArithmeticError) as error:
        raise CalculationError(f"cannot calculate {expression!r}: {error}") from None
    except Exception as error:  # simpleeval's own refusals
        raise CalculationError(f"not arithmetic: {error}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalculationError(f"{expression!r} is not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculationError(f"{expression!r} has no finite value")
    if isinstance(value, int) and abs(value) >= LIMIT:
        raise _too_large()
    return value
