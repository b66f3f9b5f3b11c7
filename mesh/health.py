"""Client-side health probes, as Kubernetes and `aimesh health` ask them."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.tls import TlsSettings, plain_channel

UNREACHABLE = "UNREACHABLE"


async def probe(
    target: str, service: str = "", timeout_s: float = 1.0, tls: TlsSettings | None = None
) -> str:
    """The ServingStatus name for `service` at `target`, or UNREACHABLE / NOT_FOUND."""
    async with plain_channel(target, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            return "NOT_FOUND" if error.code() == grpc.StatusCode.NOT_FOUND else UNREACHABLE
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def wait_until_serving(
    target: str,
    service: str,
    timeout_s: float,
    interval_s: float = 0.2,
    tls: TlsSettings | None = None,
) -> bool:
    """Polls readiness until SERVING or the timeout passes."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while loop.time() < give_up:
        if await probe(target, service, tls=tls) == "SERVING":
            return True
        await asyncio.sleep(interval_s)
    return False
