"""Tool arguments checked against the tool's JSON Schema before the tool runs."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator

from mesh.validation import Violations


def schema_path(error_path: Any) -> str:
    """`arguments.items[2].name` for the instance path ['items', 2, 'name']."""
    path = "arguments"
    for part in error_path:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> Violations:
    """Every place `arguments` breaks `schema`, each named by its path."""
    violations = Violations()
    validator = Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(arguments), key=lambda e: list(e.path)):
        violations.add(schema_path(error.absolute_path), error.message)
    return violations
