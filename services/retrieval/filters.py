"""The API's payload filter, checked and turned into Qdrant's."""

from __future__ import annotations

import math
import re

from qdrant_client import models

from aimesh.retrieval.v1 import retrieval_pb2
from mesh.validation import Violations
from services.retrieval.store import RESERVED_PREFIX

MAX_CONDITIONS = 64
MAX_KEY_BYTES = 256
MAX_KEYWORD_BYTES = 64 * 1024
# Qdrant's payload key path, as both its server and its embedded mode parse it: names of
# letters, digits, "_" and "-" (or any text in double quotes) joined by dots, each with
# optional [] or [index]. Anything else made the embedded store raise ValueError (INTERNAL).
_SEGMENT = r'(?:[\w-]+|"[^"]*")(?:\[[0-9]{0,19}\])*'
_KEY = re.compile(rf"{_SEGMENT}(?:\.{_SEGMENT})*")


def _check_key(key: str, field: str, violations: Violations) -> bool:
    if not violations.check(bool(key), field, "must not be empty"):
        return False
    if not violations.max_length(key.encode(), field, MAX_KEY_BYTES):
        return False
    if not violations.check(
        _KEY.fullmatch(key) is not None,
        field,
        'must be a payload path: names of letters, digits, "_" or "-" (or "quoted") joined '
        "by dots, each optionally followed by [] or [index]",
    ):
        return False
    first = key[1 : key.index('"', 1)] if key.startswith('"') else key
    return violations.check(
        not first.startswith(RESERVED_PREFIX),
        field,
        f"keys starting with {RESERVED_PREFIX!r} are reserved",
    )


def _condition(
    condition: retrieval_pb2.Condition, field: str, violations: Violations
) -> models.FieldCondition | None:
    ok = _check_key(condition.key, f"{field}.key", violations)
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
        criterion = {"range": models.Range(**bounds)}
    else:
        value = getattr(condition, kind)
        if kind == "keyword":
            ok &= violations.max_length(value.encode(), f"{field}.keyword", MAX_KEYWORD_BYTES)
        criterion = {"match": models.MatchValue(value=value)}
    return models.FieldCondition(key=condition.key, **criterion) if ok else None


def to_qdrant(
    filter_: retrieval_pb2.Filter, field: str, violations: Violations
) -> models.Filter | None:
    """None for an empty filter (matches everything) or an invalid one (with violations)."""
    groups = {"must": filter_.must, "should": filter_.should, "must_not": filter_.must_not}
    total = sum(len(group) for group in groups.values())
    if total == 0:
        return None
    if not violations.check(
        total <= MAX_CONDITIONS, field, f"at most {MAX_CONDITIONS} conditions, got {total}"
    ):
        return None
    converted = {
        name: [_condition(c, f"{field}.{name}[{i}]", violations) for i, c in enumerate(group)]
        for name, group in groups.items()
    }
    if any(c is None for conds in converted.values() for c in conds):
        return None  # the violations say why; the caller refuses the request
    return models.Filter(**{name: conds or None for name, conds in converted.items()})
