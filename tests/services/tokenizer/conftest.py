"""Tokenizer fixtures: the embedded model, converted once per machine, and transformers'
own tokenizer as the reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from mesh.config import MeshSettings
from services.llm.artifacts import resolve_model
from services.llm.settings import llm_settings
from services.tokenizer.engine import TokenizerEngine

# Shared by every test and every run: converting the GGUF takes ~20 s, verifying it ~0.3 s.
CACHE_DIR = Path(os.environ.get("AIMESH_TEST_CACHE", Path.home() / ".cache" / "aimesh"))


@pytest.fixture(scope="session")
def mesh_settings() -> MeshSettings:
    return MeshSettings(cache_dir=CACHE_DIR)


@pytest.fixture(scope="session")
def model_dir(mesh_settings: MeshSettings) -> Path:
    return resolve_model(llm_settings(mesh_settings).model, mesh_settings.cache_dir)


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> TokenizerEngine:
    return TokenizerEngine.load(model_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """transformers' own tokenizer, the reference the service must agree with."""
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
