"""What one service process runs (aimesh.mesh.v1.InfoService), answered by the runtime.

Engines describe what they loaded with `MeshServer.describe(ModelInfo(...))` once it is
loaded; the answer is there during loading too (no models yet), so a caller can tell a
process still loading from one serving the wrong revision.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import grpc

from aimesh.mesh.v1 import info_pb2, info_pb2_grpc
from mesh.tls import TlsSettings, plain_channel

SERVICE = info_pb2.DESCRIPTOR.services_by_name["InfoService"]
ModelInfo = info_pb2.ModelInfo


def _version() -> str:
    try:
        return version("aimesh")
    except PackageNotFoundError:  # a source tree run without `pip install -e .`
        return "unknown"


class InfoServicer(info_pb2_grpc.InfoServiceServicer):
    def __init__(self, service: str, loaded: Callable[[], bool]) -> None:
        self.service = service
        self.models: list[info_pb2.ModelInfo] = []
        # Kept up to date by their owners: each GetInfo answers their state then.
        self.external_servers: list[info_pb2.ExternalServer] = []
        self._loaded = loaded
        self._version = _version()

    async def GetInfo(
        self, request: info_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> info_pb2.GetInfoResponse:
        return info_pb2.GetInfoResponse(
            service=self.service,
            version=self._version,
            models=self.models,
            loaded=self._loaded(),
            external_servers=self.external_servers,
        )


async def get_info(
    target: str, timeout_s: float = 1.0, tls: TlsSettings | None = None
) -> info_pb2.GetInfoResponse | None:
    """One GetInfo over a plain channel (no breaker: a CLI's one-off look); None if the
    process does not answer."""
    async with plain_channel(target, tls) as channel:
        try:
            return await info_pb2_grpc.InfoServiceStub(channel).GetInfo(
                info_pb2.GetInfoRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return None


def summary(model: info_pb2.ModelInfo) -> str:
    """One line for a table: name, dtype, device, engine."""
    parts = [model.name, model.dtype, model.device, model.engine]
    return " ".join(part for part in parts if part)
