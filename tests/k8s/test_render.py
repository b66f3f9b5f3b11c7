"""k8s/render.py's output is committed; it must be what the script renders today."""

from __future__ import annotations

import dataclasses

import pytest

from mesh.registry import discover
from tests.k8s.conftest import K8S, load_render

pytestmark = pytest.mark.system


def test_committed_manifests_are_fresh():
    render = load_render()
    files = render.render()
    stale = [
        str(path.relative_to(K8S))
        for path, text in files.items()
        if not path.is_file() or path.read_text() != text
    ]
    assert not stale, "rerun `.venv/bin/python k8s/render.py`; stale: " + ", ".join(stale)
    leftovers = set(render.generated_files()) - set(files)
    assert not leftovers, f"no service renders these any more: {sorted(leftovers)}"


def test_diagnostic_services_stay_out_of_the_base():
    files = load_render().render()
    base = files[K8S / "base" / "services" / "kustomization.yaml"]
    diagnostics = files[K8S / "components" / "diagnostics" / "kustomization.yaml"]
    assert "echo.yaml" not in base and "decode.yaml" in base
    assert "echo.yaml" in diagnostics and "kind: Component" in diagnostics


def test_a_service_without_sizing_fails_the_render(monkeypatch):
    render = load_render()
    specs = discover()
    extra = dataclasses.replace(specs["echo"], name="newcomer", default_port=50120)
    assert 50120 not in {spec.default_port for spec in specs.values()}
    monkeypatch.setattr(render, "discover", lambda: {**specs, "newcomer": extra})
    with pytest.raises(SystemExit, match="newcomer"):
        render.render()


def test_drain_periods_come_from_the_config_file_alone(tmp_path, monkeypatch):
    render = load_render()
    config = tmp_path / "aimesh.toml"
    config.write_text("[services.prefill]\ngrace_s = 95.5\n")
    # A developer's shell must not leak into committed manifests.
    monkeypatch.setenv("AIMESH_SERVICES__PREFILL__GRACE_S", "1")
    settings = render.load_settings(config)
    assert settings.service("prefill").grace_s == 95.5
    assert settings.service("decode").grace_s == 15  # ServiceSettings' default
    pre_stop, margin = render.PRE_STOP_S, render.EXIT_MARGIN_S
    assert render.termination_grace_s(settings.service("prefill")) == pre_stop + 96 + margin


def secret_directories(render, settings, name: str) -> dict[str, str]:
    """Where the rendered Deployment of `name` mounts a Secret: path -> Secret name."""
    deployment = render.deployment(discover()[name], settings, render.SIZING[name])
    pod = deployment["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    (container,) = pod["containers"]
    mounts = container["volumeMounts"]
    return {m["mountPath"]: secrets[m["name"]] for m in mounts if m["name"] in secrets}


def test_the_tenants_file_is_mounted_wherever_it_is_set_in_exactly_the_metering_services(
    tmp_path,
):
    """[limits] tenants_file's directory, from the tenants Secret, in each service that
    meters and no other; none where it is unset; one mount where the gateway's own key
    file lies in the same Secret directory."""
    render = load_render()
    config = tmp_path / "aimesh.toml"
    config.write_text('[limits]\ntenants_file = "/etc/tenants/limits.json"\n')
    settings = render.load_settings(config)
    for name in discover():
        mounts = secret_directories(render, settings, name)
        expected = {"/etc/tenants": render.TENANTS_SECRET} if name in render.METERED else {}
        assert mounts == expected, name
    config.write_text("[limits]\nwindow_s = 1\n")
    settings = render.load_settings(config)
    assert not any(secret_directories(render, settings, name) for name in discover())
    settings = render.load_settings()  # the committed config: the gateway's key file
    keys = str(settings.limits.tenants_file.parent)
    assert secret_directories(render, settings, "gateway") == {keys: "aimesh-gateway-keys"}
    assert secret_directories(render, settings, "generation") == {keys: "aimesh-gateway-keys"}


def test_a_tenants_file_where_another_secret_is_mounted_fails_the_render(monkeypatch):
    render = load_render()
    monkeypatch.setattr(render, "TENANTS_SECRET", "aimesh-tenants")
    settings = render.load_settings()  # tenants_file beside the gateway's keys
    with pytest.raises(SystemExit, match="aimesh-gateway-keys"):
        render.deployment(discover()["gateway"], settings, render.SIZING["gateway"])
