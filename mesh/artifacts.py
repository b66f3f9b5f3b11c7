"""Artifacts built once and trusted only while they match their manifest.

A converted model, an exported ONNX graph, an embedded index: expensive to make, cheap to
check. `build_once` makes one under a file lock (processes starting together build it
once), writes a manifest of every file's size and sha256, and swaps it into place
atomically; every later call verifies the manifest first and rebuilds what fails it, so a
corrupt or truncated artifact is never served (the seed articles' model-file integrity
check).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mesh.failures import NotReady

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_CHUNK = 8 * 1024 * 1024


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, source: str) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    (directory / MANIFEST).write_text(json.dumps({"source": source, "files": files}, indent=2))


def manifest_problems(directory: Path) -> list[str]:
    """Why `directory` cannot be trusted; empty when every file matches its manifest."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path} is missing"]
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as error:
        return [f"{manifest_path} is unreadable: {error}"]
    problems = []
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != expected["size"]:
            problems.append(f"{name} is {path.stat().st_size} bytes, expected {expected['size']}")
        elif sha256_of(path) != expected["sha256"]:
            problems.append(f"{name} does not match its sha256")
    return problems


def artifact_digest(directory: Path) -> str:
    """One sha256 for a whole checked artifact, from its manifest (no file is read again):
    of the sorted `name sha256` lines of every file it lists. Empty without a manifest."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return ""
    lines = "".join(f"{name} {files[name]['sha256']}\n" for name in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


@contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(target: Path, build: Callable[[Path], None], source: str) -> Path:
    """`target`, verified; built by `build(scratch_directory)` if missing or corrupt."""
    with locked(target.parent / f"{target.name}.lock"):
        if target.exists():
            problems = manifest_problems(target)
            if not problems:
                return target
            log.warning(
                "artifact is corrupt, rebuilding",
                extra={"target": str(target), "problems": problems},
            )
        log.info("building artifact once", extra={"target": str(target), "source": source})
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(scratch)
            write_manifest(scratch, source)
            if target.exists():
                shutil.rmtree(target)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    problems = manifest_problems(target)
    if problems:
        raise NotReady(f"{target} fails its manifest right after building: {problems}")
    return target
