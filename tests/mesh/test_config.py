"""Typed settings: defaults, TOML file, environment overrides, and their precedence."""

from __future__ import annotations

import pytest
from pydantic import Field, ValidationError

from mesh.config import MeshSettings, ServiceOptions
from mesh.registry import discover, options_problems

pytestmark = pytest.mark.unit


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


class RouterLike(ServiceOptions):
    decode: list[str] = Field(default_factory=list)
    batch: int = 1
    label: str | None = None


def test_a_services_own_keys_sit_in_its_table_and_lists_come_from_the_environment(
    tmp_path, monkeypatch
):
    """A list set from the environment arrives as a string; its JSON is decoded for a list
    field only (a str field keeps it as written)."""
    config = tmp_path / "aimesh.toml"
    config.write_text('[services.router]\nport = 50400\nbatch = 4\nlabel = "[not json]"\n')
    monkeypatch.setenv("AIMESH_CONFIG", str(config))
    monkeypatch.setenv("AIMESH_SERVICES__ROUTER__DECODE", '["127.0.0.1:1", "127.0.0.1:2"]')
    service = MeshSettings().service("router")
    assert service.port == 50400
    own = RouterLike.model_validate(service.own())
    assert own == RouterLike(decode=["127.0.0.1:1", "127.0.0.1:2"], batch=4, label="[not json]")


def test_a_typo_in_a_services_table_is_named_before_anything_starts(monkeypatch):
    monkeypatch.setenv("AIMESH_SERVICES__ECHO__MAX_QEUE", "3")
    monkeypatch.setenv("AIMESH_SERVICES__AGENT__PORT", "x")
    with pytest.raises(ValidationError, match="port"):
        MeshSettings()
    monkeypatch.delenv("AIMESH_SERVICES__AGENT__PORT")
    problems = options_problems([discover()["echo"]], MeshSettings())
    assert problems == ["[services.echo] max_qeue: Extra inputs are not permitted"]
