"""The exported ONNX graph is an artifact: verified at every load, rebuilt when corrupt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mesh.artifacts import MANIFEST, manifest_problems
from services.embedder.backends import ONNX_DIRECTORY, ONNX_FILE, OnnxBackend, onnx_graph
from services.embedder.encoder import Encoder
from services.embedder.model import SentenceModel
from services.shared.minilm import pad
from tests.services.embedder.conftest import CACHE_DIR, TEXTS, assert_same_vectors

pytestmark = pytest.mark.unit


@pytest.mark.system  # the ONNX export again
def test_a_corrupt_graph_is_rebuilt_at_the_next_load(
    tmp_path: Path, model: SentenceModel, onnx_encoder: Encoder
):
    built = CACHE_DIR / "models" / ONNX_DIRECTORY  # the session's, verified by onnx_encoder
    target = tmp_path / "models" / ONNX_DIRECTORY
    shutil.copytree(built, target)
    graph = target / ONNX_FILE
    with graph.open("r+b") as handle:  # same size, different bytes: only sha256 can tell
        handle.seek(graph.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert manifest_problems(target) == [f"{ONNX_FILE} does not match its sha256"]

    assert onnx_graph(model, tmp_path) == graph
    assert manifest_problems(target) == []
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["source"] == str(model.path)
    rows = [t.ids for t in onnx_encoder.tokenizer.tokenize(TEXTS, "right")]
    rebuilt = OnnxBackend(graph, threads=1).pool(*pad(rows))
    assert_same_vectors(rebuilt, onnx_encoder.backend.pool(*pad(rows)), tolerance=1e-6)
