"""Tool arguments: bounded and made JSON first, then checked against the tool's JSON Schema.

The bounds come before the schema because the schema cannot give them: a Struct may hold
NaN or Infinity (which JSON cannot), nest deeper than any validator should recurse, or be
megabytes of strings whose every error message would quote them whole.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import struct_pb2
from jsonschema import Draft202012Validator

from mesh.failures import FieldViolation, InvalidInput
from mesh.validation import Violations

# Serialized size; the built-in tools need a few hundred bytes.
MAX_ARGUMENT_BYTES = 64 * 1024
# Objects and lists, the arguments object itself counted as 1.
MAX_DEPTH = 16
# A refusal travels in trailing metadata (16 KiB at most), so it is kept short.
MAX_VIOLATIONS = 10
MAX_TEXT = 200


def clipped(text: str) -> str:
    return text if len(text) <= MAX_TEXT else f"{text[: MAX_TEXT - 1]}…"


def schema_path(error_path: Any) -> str:
    """`arguments.items[2].name` for the instance path ['items', 2, 'name']."""
    return "arguments" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error_path)


class _Reader:
    """Struct -> JSON values, collecting at most MAX_VIOLATIONS problems on the way."""

    def __init__(self) -> None:
        self.problems: list[FieldViolation] = []

    def refuse(self, path: str, description: str) -> None:
        if len(self.problems) < MAX_VIOLATIONS:
            self.problems.append(FieldViolation(clipped(path), description))

    def struct(self, struct: struct_pb2.Struct, path: str, depth: int) -> dict[str, Any]:
        return {
            key: self.value(value, f"{path}.{key}", depth) for key, value in struct.fields.items()
        }

    def value(self, value: struct_pb2.Value, path: str, depth: int) -> Any:
        """`value`, held by an object or list `depth` deep."""
        kind = value.WhichOneof("kind")
        if kind in ("struct_value", "list_value") and depth >= MAX_DEPTH:
            self.refuse(path, f"must nest at most {MAX_DEPTH} objects and lists deep")
            return None
        if kind == "struct_value":
            return self.struct(value.struct_value, path, depth + 1)
        if kind == "list_value":
            items = value.list_value.values
            return [self.value(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(items)]
        if kind == "number_value" and not math.isfinite(value.number_value):
            self.refuse(path, "must be a finite number (JSON has no NaN or Infinity)")
        return None if kind in (None, "null_value") else getattr(value, kind)


def arguments_of(arguments: struct_pb2.Struct) -> dict[str, Any]:
    """`arguments` as JSON values; InvalidInput when too large, too deep or not finite.

    The size is checked first, in C, so a huge Struct costs nothing to refuse; that also
    bounds the walk, whose recursion MAX_DEPTH bounds."""
    size = arguments.ByteSize()
    if size > MAX_ARGUMENT_BYTES:
        raise InvalidInput(
            [FieldViolation("arguments", f"must be at most {MAX_ARGUMENT_BYTES} bytes, got {size}")]
        )
    reader = _Reader()
    value = reader.struct(arguments, "arguments", 1)
    if reader.problems:
        raise InvalidInput(reader.problems)
    return value


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> Violations:
    """Every place `arguments` breaks `schema` (the first MAX_VIOLATIONS), each named by
    its path; messages that quote the argument are clipped."""
    violations = Violations()
    validator = Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
    for error in errors[:MAX_VIOLATIONS]:
        violations.add(clipped(schema_path(error.absolute_path)), clipped(error.message))
    return violations
