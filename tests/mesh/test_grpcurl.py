"""What an engineer debugging the mesh does: grpcurl against a running service."""

from __future__ import annotations

import asyncio
import json

import pytest

from mesh.config import MeshSettings
from tests.conftest import ROOT, VENV_BIN
from tests.harness import InProcess

pytestmark = pytest.mark.service


async def grpcurl(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "grpcurl"),
        "-plaintext",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=30)
    return process.returncode, output.decode()


async def test_list_shows_the_service_health_info_and_reflection(serve_process):
    child = await serve_process("echo")
    code, output = await grpcurl(child.target, "list")
    assert code == 0, output
    assert set(output.split()) == {
        "aimesh.echo.v1.EchoService",
        "aimesh.mesh.v1.InfoService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    code, output = await grpcurl(child.target, "aimesh.mesh.v1.InfoService/GetInfo")
    assert code == 0, output
    assert json.loads(output)["service"] == "echo"


async def test_health_check_liveness_and_readiness(serve_process):
    child = await serve_process("echo")
    for service in ("", "echo", "aimesh.echo.v1.EchoService"):
        code, output = await grpcurl(
            "-d", json.dumps({"service": service}), child.target, "grpc.health.v1.Health/Check"
        )
        assert code == 0, output
        assert json.loads(output) == {"status": "SERVING"}
    code, output = await grpcurl(
        "-d", '{"service": "nope"}', child.target, "grpc.health.v1.Health/Check"
    )
    assert code != 0 and "NotFound" in output


async def test_call_with_json_and_read_rich_error_details(serve_process):
    child = await serve_process("echo")
    code, output = await grpcurl(
        "-d", '{"payload": "aGVsbG8="}', child.target, "aimesh.echo.v1.EchoService/Echo"
    )
    assert code == 0, output
    assert json.loads(output)["payload"] == "aGVsbG8="

    code, output = await grpcurl(
        "-d", '{"delay_ms": -5}', child.target, "aimesh.echo.v1.EchoService/Echo"
    )
    assert code != 0
    assert "InvalidArgument" in output
    assert "google.rpc.BadRequest" in output and '"field":"delay_ms"' in output.replace(" ", "")


async def test_describe_shows_http_annotations(serve_process):
    child = await serve_process("echo")
    code, output = await grpcurl(child.target, "describe", "aimesh.echo.v1.EchoService")
    assert code == 0, output
    assert 'post:"/v1/echo"' in output.replace(" ", "")


async def test_without_reflection_grpcurl_needs_the_protos(tmp_path):
    """`reflection = false` (the Kubernetes config): listing fails, a call with the
    protos named still works."""
    async with InProcess() as services:
        served = await services.start("echo", MeshSettings(reflection=False))
        code, output = await grpcurl(served.target, "list")
        assert code != 0 and "reflection" in output.lower(), output
        code, output = await grpcurl(
            "-import-path", str(ROOT / "protos"),
            "-import-path", str(ROOT / "third_party" / "googleapis"),
            "-proto", "aimesh/echo/v1/echo.proto",
            "-d", '{"payload": "aGk="}', served.target, "aimesh.echo.v1.EchoService/Echo",
        )  # fmt: skip
        assert code == 0 and json.loads(output)["payload"] == "aGk=", output
