"""Typed settings: defaults, TOML file, environment overrides, and their precedence."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mesh.config import MeshSettings


def test_defaults_derive_addresses_from_the_spec_port(monkeypatch):
    monkeypatch.delenv("AIMESH_CONFIG", raising=False)
    settings = MeshSettings()
    assert settings.target_of("decode", 50063) == "127.0.0.1:50063"
    assert settings.metrics_port_of("decode", 50063) == 51063
    assert settings.client.default_unary_deadline_s == 10.0


def test_toml_file_then_environment_override(tmp_path, monkeypatch):
    config = tmp_path / "aimesh.toml"
    config.write_text(
        "[services.decode]\n"
        "port = 51000\n"
        "max_concurrency = 16\n"
        'target = "dns:///decode.aimesh.svc:50063"\n'
        "[client]\n"
        "default_unary_deadline_s = 3.5\n"
    )
    monkeypatch.setenv("AIMESH_CONFIG", str(config))
    monkeypatch.setenv("AIMESH_SERVICES__DECODE__MAX_CONCURRENCY", "32")
    settings = MeshSettings()
    assert settings.port_of("decode", 50063) == 51000
    assert settings.service("decode").max_concurrency == 32  # env beats the file
    assert settings.target_of("decode", 50063) == "dns:///decode.aimesh.svc:50063"
    assert settings.client.default_unary_deadline_s == 3.5


def test_invalid_values_are_refused(monkeypatch):
    monkeypatch.setenv("AIMESH_SERVICES__DECODE__MAX_CONCURRENCY", "0")
    with pytest.raises(ValidationError):
        MeshSettings()


def test_metrics_port_zero_disables_exposition(monkeypatch):
    monkeypatch.setenv("AIMESH_SERVICES__ECHO__METRICS_PORT", "0")
    assert MeshSettings().metrics_port_of("echo", 50100) == 0
