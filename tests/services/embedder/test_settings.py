"""The embedder's backend choice is checked when the settings load, not at the first call."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.embedder.settings import EmbedderSettings

pytestmark = pytest.mark.unit


def test_the_triton_backend_needs_to_know_where_triton_is():
    with pytest.raises(ValidationError, match=r"services\.embedder\.triton"):
        EmbedderSettings(backend="triton")
    settings = EmbedderSettings.model_validate(
        {"backend": "triton", "triton": {"url": "triton:8001", "model": "sentence_embedding"}}
    )
    assert settings.triton is not None and settings.triton.timeout_s == 30.0


def test_a_triton_section_without_a_model_name_is_refused():
    with pytest.raises(ValidationError, match="model"):
        EmbedderSettings.model_validate({"backend": "triton", "triton": {"url": "triton:8001"}})
