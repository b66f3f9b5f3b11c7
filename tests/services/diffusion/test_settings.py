"""Diffusion settings as they arrive from a config file or from the environment, checked
when they load rather than at the first job."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mesh.config import MeshSettings
from services.diffusion.settings import DiffusionSettings

pytestmark = pytest.mark.unit


def test_models_may_come_as_a_list_or_as_comma_separated_text():
    assert DiffusionSettings(models=["digits"]).models == ["digits"]
    assert DiffusionSettings.model_validate({"models": "digits, terrain"}).models == [
        "digits",
        "terrain",
    ]
    with pytest.raises(ValidationError):
        DiffusionSettings.model_validate({"models": "digits,sdxl"})


def test_terrain_on_triton_needs_to_know_where_triton_is():
    with pytest.raises(ValidationError, match=r"services\.diffusion\.triton"):
        DiffusionSettings(terrain_backend="triton")
    settings = DiffusionSettings.model_validate(
        {"terrain_backend": "triton", "triton": {"url": "triton:8001", "model": "terrain_denoiser"}}
    )
    assert settings.triton is not None and settings.triton.timeout_s == 30.0
    assert DiffusionSettings().terrain_backend == "onnx"


def test_a_triton_section_without_a_model_or_with_a_zero_timeout_is_refused():
    with pytest.raises(ValidationError, match="model"):
        DiffusionSettings.model_validate(
            {"terrain_backend": "triton", "triton": {"url": "triton:8001"}}
        )
    with pytest.raises(ValidationError, match="timeout_s"):
        DiffusionSettings.model_validate(
            {
                "terrain_backend": "triton",
                "triton": {"model": "terrain_denoiser", "timeout_s": 0},
            }
        )


def test_terrain_on_triton_can_be_configured_from_the_environment(monkeypatch):
    monkeypatch.setenv("AIMESH_SERVICES__DIFFUSION__TERRAIN_BACKEND", "triton")
    with pytest.raises(ValidationError, match=r"services\.diffusion\.triton"):
        DiffusionSettings.of(MeshSettings(), "diffusion")
    monkeypatch.setenv("AIMESH_SERVICES__DIFFUSION__TRITON__URL", "triton:8001")
    monkeypatch.setenv("AIMESH_SERVICES__DIFFUSION__TRITON__MODEL", "terrain_denoiser")
    settings = DiffusionSettings.of(MeshSettings(), "diffusion")
    assert settings.triton is not None
    assert (settings.triton.url, settings.triton.model) == ("triton:8001", "terrain_denoiser")
