"""The package rules of STYLE.md that a grep can check: mesh/ knows no service, and no
service imports another service's package (shared code lives in a library package under
services/ that is no service: services/shared, the LLM engine services/llm)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mesh.registry import discover

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(package: Path) -> set[tuple[Path, str]]:
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((path, node.module))
            elif isinstance(node, ast.Import):
                found |= {(path, alias.name) for alias in node.names}
    return found


def test_mesh_imports_no_service():
    offenders = {
        (str(path.relative_to(ROOT)), module)
        for path, module in imported_modules(ROOT / "mesh")
        if module == "services" or module.startswith("services.")
    }
    assert not offenders


def test_no_service_imports_another_services_package():
    services = set(discover())
    offenders = set()
    for name in services:
        for path, module in imported_modules(ROOT / "services" / name):
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] in services - {name}:
                offenders.add((str(path.relative_to(ROOT)), module))
    assert not offenders
