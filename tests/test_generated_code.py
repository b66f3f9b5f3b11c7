"""Generated code is reproducible and current: regenerating changes no byte."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def test_generated_code_is_current(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    committed = ROOT / "gen"
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    current = {
        p.relative_to(committed): p.read_bytes()
        for p in committed.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert sorted(map(str, fresh)) == sorted(map(str, current)), "run `make protos`"
    stale = [str(path) for path, data in fresh.items() if current[path] != data]
    assert not stale, f"stale generated files, run `make protos`: {stale}"


def test_every_proto_package_imports():
    import importlib

    for proto in (ROOT / "protos").rglob("*.proto"):
        module = ".".join(proto.relative_to(ROOT / "protos").with_suffix("").parts) + "_pb2"
        importlib.import_module(module)
        importlib.import_module(module + "_grpc")
