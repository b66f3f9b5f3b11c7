"""Artifacts built once, verified at every use, rebuilt when corrupt."""

from __future__ import annotations

import threading

import pytest

from mesh.artifacts import build_once, manifest_problems, write_manifest

pytestmark = pytest.mark.unit


def test_manifest_catches_truncation_bit_flips_and_missing_files(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (directory / "config.json").write_text("{}")
    write_manifest(directory, "test")
    assert manifest_problems(directory) == []
    flipped = bytearray((directory / "weights.bin").read_bytes())
    flipped[100] ^= 1
    (directory / "weights.bin").write_bytes(flipped)
    assert "sha256" in manifest_problems(directory)[0]
    (directory / "weights.bin").write_bytes(flipped[:-10])
    assert "bytes" in manifest_problems(directory)[0]
    (directory / "config.json").unlink()
    assert len(manifest_problems(directory)) == 2


def test_build_once_builds_once_and_rebuilds_what_is_corrupt(tmp_path):
    builds = []

    def build(scratch):
        builds.append(scratch)
        (scratch / "data.bin").write_bytes(b"x" * 1000)

    target = tmp_path / "artifact"
    threads = [threading.Thread(target=build_once, args=(target, build, "test")) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and (target / "data.bin").read_bytes() == b"x" * 1000
    assert build_once(target, build, "test") == target and len(builds) == 1

    (target / "data.bin").write_bytes(b"x" * 999)  # truncated
    assert build_once(target, build, "test") == target
    assert len(builds) == 2 and manifest_problems(target) == []
