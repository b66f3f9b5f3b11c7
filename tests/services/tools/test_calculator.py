"""The calculator's evaluator: arithmetic in, numbers out, anything else refused."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.tools.calculator import CalculationError, calculate


@pytest.mark.parametrize(
    ("expression", "value"),
    [("(17*23)+4", 395), ("2^10", 1024), ("7 // 2", 3), ("-3 % 5", 2), ("sqrt(16)+max(1, 2)", 6),
     ("2*pi", 2 * math.pi), ("10**400", 10**400)],
)  # fmt: skip
def test_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os')", "os.system('ls')", "x + 1", "'a' * 3", "1 < 2", "9**9**9", "1/0",
     "1e308 * 10", "(1", "", "[1, 2]", "abs", "lambda: 1"],
)  # fmt: skip
def test_anything_but_arithmetic_is_refused(expression):
    with pytest.raises(CalculationError):
        calculate(expression)


@given(st.integers(-(10**6), 10**6), st.integers(-(10**6), 10**6))
def test_agrees_with_python_on_integers(a, b):
    assert calculate(f"({a}) * ({b}) - ({b})") == a * b - b
