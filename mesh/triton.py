"""Model execution on Triton Inference Server, over a mesh channel.

A service whose engine runs on Triton must answer exactly like one running the model
itself. Its calls ride the same channel as any call to another service (mesh.client:
tracing with the caller's traceparent, which Triton's own spans join; the remaining
budget as the deadline; a circuit breaker), with Triton's generated stubs; only the
answer needs reading here, through the mesh's error table: Triton unreachable or the
model not loaded -> UNAVAILABLE; Triton's deadline, overload and cancellation -> passed
through; anything else Triton says about a request -> this service's INTERNAL error,
since inputs were validated before they got here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np
from pydantic import BaseModel, Field
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import np_to_triton_dtype

from mesh.breaker import CircuitBreaker
from mesh.client import channel_options, create_channel
from mesh.config import MeshSettings
from mesh.errors import error_info, local_error, status
from mesh.failures import NotReady

log = logging.getLogger(__name__)

# Triton's own statuses, as the mesh reads a dependency's: see the module docstring.
_NOT_READY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND}
_PASSED_THROUGH = {
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}


class TritonSettings(BaseModel, extra="forbid"):
    """Where a model lives on Triton: a service's `[services.<name>.triton]` section."""

    url: str = Field(default="127.0.0.1:8001", description="Triton's gRPC endpoint, host:port")
    model: str = Field(min_length=1, description="the model's name in Triton's repository")
    version: str = Field(default="", description="empty: the version Triton's policy picks")
    timeout_s: float = Field(
        default=30.0, gt=0, description="per call when the caller brings no deadline, and its cap"
    )
    ssl: bool = False
    root_certificates: Path | None = None
    private_key: Path | None = None
    certificate_chain: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.ssl:
            return None
        return grpc.ssl_channel_credentials(
            *(
                None if path is None else path.read_bytes()
                for path in (self.root_certificates, self.private_key, self.certificate_chain)
            )
        )


class TritonModel:
    """One model on one Triton server: its readiness, and inference on a mesh channel."""

    def __init__(self, settings: TritonSettings, mesh: MeshSettings | None = None) -> None:
        self.settings = settings
        mesh = mesh or MeshSettings()
        self.breaker = CircuitBreaker(
            f"triton:{settings.url}/{settings.model}", mesh.client.breaker
        )
        credentials = settings.credentials()
        self._channel = create_channel(
            settings.url,
            mesh,
            breaker=self.breaker,
            credentials=credentials,
            shared_subchannels=True,
        )
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        # Readiness polls go around the breaker, as mesh.health.probe does: a Triton
        # still starting must not open it for the calls that follow. Same options as the
        # call channel, both in grpc's global subchannel pool (it keys subchannels by
        # address and options), so they share one: a probe that reconnects reconnects the
        # calls too, instead of leaving them in reconnect backoff while readiness already
        # says SERVING.
        options = channel_options(mesh, shared_subchannels=True)
        self._probe_channel = (
            grpc.aio.insecure_channel(settings.url, options=options)
            if credentials is None
            else grpc.aio.secure_channel(settings.url, credentials, options=options)
        )

    async def ready(self) -> bool:
        """Triton's ModelReady for this model: the readiness of a service it backs."""
        probe = service_pb2_grpc.GRPCInferenceServiceStub(self._probe_channel)
        request = service_pb2.ModelReadyRequest(
            name=self.settings.model, version=self.settings.version
        )
        try:
            return (await probe.ModelReady(request, timeout=1.0)).ready
        except grpc.aio.AioRpcError:
            return False

    async def wait_until_ready(self, interval_s: float = 1.0) -> None:
        """Polls ModelReady until it holds: a service backed by Triton is alive but not
        ready meanwhile. Polling, since a remote server's readiness has no local event."""
        if await self.ready():
            return
        log.info(
            "waiting for Triton's model",
            extra={"url": self.settings.url, "model": self.settings.model},
        )
        while not await self.ready():  # noqa: ASYNC110
            await asyncio.sleep(interval_s)

    async def infer(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """One ModelInfer within the caller's remaining budget. Cancelling the calling task
        cancels the RPC, and Triton drops a request whose client has gone."""
        try:
            response = await self._stub.ModelInfer(
                self._request(inputs, outputs), timeout=self.settings.timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise self._mesh_error(error) from None
        result = InferResult(response)
        return {name: result.as_numpy(name) for name in outputs}

    async def stream(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        final: str,
        request_id: str = "",
    ) -> AsyncIterator[dict[str, np.ndarray | None]]:
        """One request to a decoupled model over ModelStreamInfer, its responses as they
        arrive, up to the first that carries the `final` output.

        The stream lives within the caller's remaining budget. Closing this iterator early
        (the caller has what it needs, or was cancelled) cancels the gRPC stream, and Triton
        cancels the request with it. One request per stream: `final` marks the end, and the
        request side stays open until then (half-closing it early would end the stream on
        Triton's side).
        """
        answered = asyncio.Event()
        request = self._request(inputs, outputs, request_id)

        async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield request
            await answered.wait()

        call = self._stub.ModelStreamInfer(requests(), timeout=self.settings.timeout_s)
        try:
            async for message in call:
                if message.error_message:
                    raise RuntimeError(self._where(message.error_message))
                result = InferResult(message.infer_response)
                response = {name: result.as_numpy(name) for name in outputs}
                yield response
                if response[final] is not None:
                    return
            raise RuntimeError(self._where("the stream ended before its final response"))
        except grpc.aio.AioRpcError as error:
            raise self._mesh_error(error) from None
        finally:
            answered.set()
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()
        await self._probe_channel.close()

    def _request(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], request_id: str = ""
    ) -> service_pb2.ModelInferRequest:
        request = service_pb2.ModelInferRequest(
            model_name=self.settings.model,
            model_version=self.settings.version,
            id=request_id,
            outputs=[
                service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=name)
                for name in outputs
            ],
        )
        for name, array in inputs.items():
            if array.dtype == np.object_:
                raise TypeError(f"{name}: only numeric tensors are sent to Triton")
            request.inputs.add(
                name=name, datatype=np_to_triton_dtype(array.dtype), shape=array.shape
            )
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
        return request

    def _where(self, message: str) -> str:
        return f"Triton at {self.settings.url}, model {self.settings.model!r}: {message}"

    def _mesh_error(self, error: grpc.aio.AioRpcError) -> Exception:
        if error_info(error) is not None:  # the mesh channel's own refusal: already told
            return error
        code, where = error.code(), self._where(error.details() or "")
        if code in _NOT_READY:
            return NotReady(where, reason="TRITON_UNAVAILABLE")
        if code in _PASSED_THROUGH:
            return local_error(status(code, where, reason=f"TRITON_{code.name}"))
        return RuntimeError(f"{where} ({code.name})")
