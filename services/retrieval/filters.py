"""The API's payload filter, checked and turned into Qdrant's."""

from __future__ import annotations

import math

from qdrant_client import models

from aimesh.retrieval.v1 import retrieval_pb2
from mesh.validation import Violations
from services.retrieval.store import RESERVED_PREFIX

MAX_CONDITIONS = 64


def _condition(
    condition: retrieval_pb2.Condition, field: str, violations: Violations
) -> models.FieldCondition | None:
    ok = violations.check(bool(condition.key), f"{field}.key", "must not be empty")
    ok &= violations.check(
        not condition.key.startswith(RESERVED_PREFIX),
        f"{field}.key",
        f"keys starting with {RESERVED_PREFIX!r} are reserved",
    )
    kind = condition.WhichOneof("match")
    if kind is None:
        violations.add(field, "needs one of keyword, integer, boolean or range")
        return None
    if kind == "range":
        bounds = {
            b: getattr(condition.range, b)
            for b in ("gt", "gte", "lt", "lte")
            if condition.range.HasField(b)
        }
        if not bounds:
            violations.add(f"{field}.range", "needs at least one of gt, gte, lt, lte")
            return None
        for name, value in bounds.items():
            ok &= violations.check(
                math.isfinite(value), f"{field}.range.{name}", "must be a finite number"
            )
        return (
            models.FieldCondition(key=condition.key, range=models.Range(**bounds)) if ok else None
        )
    value = getattr(condition, kind)
    return (
        models.FieldCondition(key=condition.key, match=models.MatchValue(value=value))
        if ok
        else None
    )


def to_qdrant(
    filter_: retrieval_pb2.Filter, field: str, violations: Violations
) -> models.Filter | None:
    """None for an empty filter (matches everything) or an invalid one (with violations)."""
    groups = {"must": filter_.must, "should": filter_.should, "must_not": filter_.must_not}
    total = sum(len(group) for group in groups.values())
    if total == 0:
        return None
    violations.check(
        total <= MAX_CONDITIONS, field, f"at most {MAX_CONDITIONS} conditions, got {total}"
    )
    converted = {
        name: [_condition(c, f"{field}.{name}[{i}]", violations) for i, c in enumerate(group)]
        for name, group in groups.items()
    }
    if any(c is None for conds in converted.values() for c in conds):
        return None  # the violations say why; the caller refuses the request
    return models.Filter(**{name: conds or None for name, conds in converted.items()})
