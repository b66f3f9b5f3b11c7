"""Collects every field violation of a request before refusing it.

Servicers validate once at the boundary and report all problems together, the way
google.rpc.BadRequest intends, instead of failing on the first one.
"""

from __future__ import annotations

import math

from mesh.failures import FieldViolation, InvalidInput


class Violations:
    """Accumulates FieldViolations; `raise_if_any()` turns them into one InvalidInput."""

    def __init__(self) -> None:
        self._items: list[FieldViolation] = []

    def add(self, field: str, description: str) -> None:
        self._items.append(FieldViolation(field, description))

    def check(self, ok: bool, field: str, description: str) -> bool:
        if not ok:
            self.add(field, description)
        return ok

    def in_range(self, value: float, field: str, low: float, high: float) -> bool:
        """Checks low <= value <= high and that value is a finite number (NaN fails)."""
        if isinstance(value, float) and not math.isfinite(value):
            self.add(field, f"must be a finite number, got {value}")
            return False
        return self.check(low <= value <= high, field, f"must be in [{low}, {high}], got {value}")

    def max_length(self, value: str | bytes, field: str, limit: int) -> bool:
        return self.check(
            len(value) <= limit, field, f"must be at most {limit} long, got {len(value)}"
        )

    def __bool__(self) -> bool:
        return bool(self._items)

    @property
    def items(self) -> tuple[FieldViolation, ...]:
        return tuple(self._items)

    def raise_if_any(self) -> None:
        if self._items:
            raise InvalidInput(self._items)
