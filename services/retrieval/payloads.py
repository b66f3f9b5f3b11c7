"""Document payloads (google.protobuf.Struct) checked and turned into the JSON Qdrant stores.

json_format.MessageToDict raises ValueError on NaN and Infinity, which reached callers as
INTERNAL, and accepts any depth. Payloads are converted here instead, refusing what Qdrant
cannot store or filter on sensibly: numbers must be finite, objects and lists nest at most
MAX_DEPTH deep, and a payload is at most MAX_BYTES encoded. Numbers stay floats, as
MessageToDict returned them, so the content hash of a document stored before is unchanged
and re-sending it still counts as unchanged.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import struct_pb2

from mesh.validation import Violations

MAX_DEPTH = 16
MAX_BYTES = 64 * 1024
# Violations name nested keys; a long key is cut to this many characters in the name.
_KEY_IN_NAME = 64


def to_json(payload: struct_pb2.Struct, field: str, violations: Violations) -> dict[str, Any]:
    """The payload as JSON; what it holds that cannot be stored becomes violations."""
    size = payload.ByteSize()
    if not violations.check(
        size <= MAX_BYTES, field, f"must be at most {MAX_BYTES} bytes encoded, got {size}"
    ):
        return {}
    return _struct(payload, field, 1, violations)


def _struct(
    struct: struct_pb2.Struct, field: str, depth: int, violations: Violations
) -> dict[str, Any]:
    return {
        key: _value(value, f"{field}.{key[:_KEY_IN_NAME]}", depth, violations)
        for key, value in struct.fields.items()
    }


def _value(value: struct_pb2.Value, field: str, depth: int, violations: Violations) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        violations.check(math.isfinite(number), field, f"must be a finite number, got {number}")
        return number
    if kind in ("string_value", "bool_value"):
        return getattr(value, kind)
    if kind in ("struct_value", "list_value"):
        if depth >= MAX_DEPTH:
            violations.add(field, f"objects and lists may nest at most {MAX_DEPTH} deep")
            return None
        if kind == "struct_value":
            return _struct(value.struct_value, field, depth + 1, violations)
        return [
            _value(item, f"{field}[{i}]", depth + 1, violations)
            for i, item in enumerate(value.list_value.values)
        ]
    return None  # null_value, or no kind at all: JSON null, as MessageToDict has it
