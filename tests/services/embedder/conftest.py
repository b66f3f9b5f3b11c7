"""Embedder fixtures: the embedded model on both backends, loaded once per session, and
sentence-transformers itself as the reference they must agree with.

The ONNX graph is exported into the default cache dir, so it is built once per machine
(~10 s) and only verified (~0.3 s) on later runs, by the tests and the service alike.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections.abc import Sequence

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from mesh.config import MeshSettings
from services.embedder.encoder import Encoder
from services.embedder.model import SentenceModel, default_model
from services.embedder.settings import EmbedderSettings

CACHE_DIR = MeshSettings().cache_dir

# Mixed lengths, non-ASCII text, and one passage over the model's 256 tokens.
TEXTS = [
    "hello world",
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "naïve café, Grüße aus München, 日本語のテキスト 🙂",
    " ".join(f"sentence {n} of a long passage about gRPC meshes and vectors." for n in range(40)),
]


@pytest.fixture(scope="session")
def mesh_settings() -> MeshSettings:
    return MeshSettings(cache_dir=CACHE_DIR)


@pytest.fixture(scope="session")
def model() -> SentenceModel:
    return default_model()


@pytest.fixture(scope="session")
def onnx_encoder() -> Encoder:
    return Encoder.load(EmbedderSettings(backend="onnx"), CACHE_DIR)


@pytest.fixture(scope="session")
def torch_encoder() -> Encoder:
    return Encoder.load(EmbedderSettings(backend="torch"), CACHE_DIR)


@pytest.fixture(scope="session")
def sentence_transformer(model: SentenceModel) -> SentenceTransformer:
    return SentenceTransformer(str(model.path), device="cpu")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [n, d] arrays."""
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def assert_same_vectors(a: np.ndarray, b: np.ndarray | Sequence, tolerance: float = 1e-4) -> None:
    """Equal within `tolerance` in cosine and in every component."""
    b = np.asarray(b, dtype=np.float32)
    assert a.shape == b.shape
    assert cosines(a, b).min() >= 1 - tolerance
    np.testing.assert_allclose(a, b, atol=tolerance, rtol=0)
