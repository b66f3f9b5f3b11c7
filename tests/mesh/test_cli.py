"""`aimesh up` starts every service as its own process; `aimesh health` reports them."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import urllib.request

import grpc
import psutil
import pytest

from aimesh.echo.v1 import echo_pb2, echo_pb2_grpc
from mesh.authz import OPERATOR
from mesh.health import probe, wait_until_serving
from mesh.tls import TlsSettings
from tests.conftest import (
    VENV_BIN,
    free_port,
    start_mesh,
    stop_mesh,
    subprocess_env,
)

pytestmark = pytest.mark.service


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


async def run(*args: str, env: dict[str, str]) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode, output.decode()


# `aimesh serve` processes, seconds each: the system tier keeps make test-fast under 3 min.
@pytest.mark.system
async def test_up_health_metrics_and_drain_on_sigterm(tmp_path):
    port, metrics_port = free_port(), free_port()
    env = subprocess_env(
        AIMESH_SERVICES__ECHO__PORT=str(port),
        AIMESH_SERVICES__ECHO__METRICS_PORT=str(metrics_port),
        COLUMNS="200",
    )
    # Nothing is running yet: health says so and fails.
    code, output = await run("health", "--only", "echo", env=env)
    assert code == 1 and "UNREACHABLE" in output

    # Only what this test checks: the supervisor, health, metrics and drain are the same
    # for one service as for eleven, and eleven take a minute or more to start.
    up = await start_mesh(
        "--only", "echo", "--log-dir", str(tmp_path), env=env, output=asyncio.subprocess.PIPE
    )
    try:
        await _check_then_drain(up, port, metrics_port, env, tmp_path)
    finally:
        await stop_mesh(up)


async def test_sigterm_while_starting_stops_what_was_started(tmp_path):
    """Before the mesh is up `aimesh up` has no handler of its own: the default SIGTERM
    killed it and left its children running with no supervisor (seen with eight
    services mid-start). Now they are drained, however early the signal comes."""
    env = subprocess_env(AIMESH_SERVICES__ECHO__PORT=str(free_port()))
    up = await start_mesh("--only", "echo", "--log-dir", str(tmp_path), env=env)
    try:
        supervisor = psutil.Process(up.pid)
        while not supervisor.children():  # noqa: ASYNC110 (bounded by the test timeout)
            await asyncio.sleep(0.01)
        (child,) = supervisor.children()
        up.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(up.wait(), timeout=60) == 128 + signal.SIGTERM
        assert not child.is_running()
    finally:
        await stop_mesh(up)


async def _check_then_drain(up, port: int, metrics_port: int, env, tmp_path) -> None:
    banner = b""
    while b"mesh is up" not in banner:
        line = await asyncio.wait_for(up.stdout.readline(), timeout=120)
        assert line, f"aimesh up exited early: {banner.decode()}"
        banner += line
    assert f"127.0.0.1:{port}".encode() in banner
    assert "cold start" in banner.decode() and re.search(r"ready\s*│\s*[\d.]+ s", banner.decode())

    code, output = await run("health", "--only", "echo", env=env)
    assert code == 0, output
    assert output.count("SERVING") == 2  # live and ready

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await echo_pb2_grpc.EchoServiceStub(channel).Echo(echo_pb2.EchoRequest(), timeout=5)
    exposition = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics_port}/metrics")
    assert (
        'aimesh_rpc_server_handled_total{grpc_code="OK",grpc_method="Echo",'
        'grpc_service="aimesh.echo.v1.EchoService"} 1.0'
    ) in exposition

    # A service that dies (kill -9 here; a broken one exits 1 by itself) is restarted.
    (child,) = psutil.Process(up.pid).children()
    child.kill()
    said = b""
    while b"restarting" not in said:
        line = await asyncio.wait_for(up.stdout.readline(), timeout=60)
        assert line, f"aimesh up exited: {said.decode()}"
        said += line
    assert b"echo exited with status -9" in said
    assert await wait_until_serving(f"127.0.0.1:{port}", "echo", timeout_s=120)
    (restarted,) = psutil.Process(up.pid).children()
    assert restarted.pid != child.pid

    up.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(up.wait(), timeout=30) == 0
    code, output = await run("health", "--only", "echo", env=env)
    assert code == 1  # every child drained and exited
    log = (tmp_path / "echo.log").read_text()
    assert '"message": "draining"' in log and '"message": "stopped"' in log


def test_the_cli_imports_no_engine():
    """Every aimesh command (and every service process) starts with `import mesh.cli`:
    torch and transformers there cost seconds before the first byte of any command."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, mesh.cli; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not {"torch", "transformers", "onnxruntime", "qdrant_client"} & set(loaded)


def test_a_services_environment_is_set_before_its_engine_loads_and_the_users_wins(monkeypatch):
    """`aimesh serve` sets a spec's environment (OpenMP's wait policy for prefill) before
    the setup imports torch, which reads it once, when it loads; a value already set
    stays."""
    script = (
        "import os, sys, mesh.cli; from mesh.config import MeshSettings; "
        "spec = mesh.cli._spec('prefill'); spec.apply_environment(); "
        "mesh.cli._refuse_bad_options([spec], MeshSettings()); "
        "print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    )

    def serve_start(**env: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env=subprocess_env(**env),
        ).stdout.strip()

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert serve_start() == "PASSIVE False"
    assert serve_start(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE False"


async def test_up_with_tls_serves_mutual_tls_callers_only(tmp_path):
    """`aimesh up --tls`: every process on certificates of a throwaway CA, and up's own
    readiness checks over them (it says the mesh is up); a caller with the certificate
    it names gets through, a plaintext one does not."""
    port = free_port()
    env = subprocess_env(
        AIMESH_SERVICES__ECHO__PORT=str(port),
        AIMESH_SERVICES__ECHO__METRICS_PORT="0",
        AIMESH_CACHE_DIR=str(tmp_path),
        COLUMNS="200",
    )
    up = await start_mesh("--only", "echo", "--tls", env=env, output=asyncio.subprocess.PIPE)
    try:
        banner = b""
        while b"mesh is up" not in banner:
            line = await asyncio.wait_for(up.stdout.readline(), timeout=120)
            assert line, f"aimesh up exited early: {banner.decode()}"
            banner += line
        caller = TlsSettings(
            cert_file=tmp_path / "tls" / f"{OPERATOR}.pem",
            key_file=tmp_path / "tls" / f"{OPERATOR}.key",
            ca_file=tmp_path / "tls" / "ca.pem",
        )
        assert f"mutual TLS: CA {caller.ca_file}" in banner.decode()
        target = f"127.0.0.1:{port}"
        assert await probe(target, "echo", tls=caller) == "SERVING"
        assert await probe(target, "echo") == "UNREACHABLE"
        up.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(up.wait(), timeout=30) == 0
    finally:
        await stop_mesh(up)
