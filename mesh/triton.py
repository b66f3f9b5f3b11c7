"""Model execution on Triton Inference Server, through tritonclient's asyncio gRPC client.

A service whose engine runs on Triton must answer exactly like one running the model
itself, so every call here carries the caller's remaining budget as its client timeout,
passes a circuit breaker of its own (tritonclient owns its channel: the mesh's channel
interceptors never see these calls), and comes back through the mesh's error table:
Triton unreachable or the model not loaded -> UNAVAILABLE; Triton's deadline, overload
and cancellation -> passed through; anything else Triton says about a request -> this
service's INTERNAL error, since inputs were validated before they got here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_aio
from opentelemetry import propagate, trace
from pydantic import BaseModel, Field
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mesh import deadline
from mesh.breaker import CircuitBreaker
from mesh.config import BreakerSettings
from mesh.errors import local_error, status
from mesh.failures import NotReady

log = logging.getLogger(__name__)
_TRACER = trace.get_tracer(__name__)
_TRITON_SERVICE = "inference.GRPCInferenceService"

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


class TritonModel:
    """One model on one Triton server: its readiness, and ModelInfer behind a breaker."""

    def __init__(self, settings: TritonSettings, breaker: BreakerSettings | None = None) -> None:
        self.settings = settings
        self._client = triton_aio.InferenceServerClient(
            settings.url,
            ssl=settings.ssl,
            root_certificates=_path(settings.root_certificates),
            private_key=_path(settings.private_key),
            certificate_chain=_path(settings.certificate_chain),
        )
        self.breaker = CircuitBreaker(f"triton:{settings.url}/{settings.model}", breaker)

    async def ready(self) -> bool:
        """Triton's ModelReady for this model: the readiness of a service it backs."""
        try:
            return await self._client.is_model_ready(
                self.settings.model, self.settings.version, client_timeout=1.0
            )
        except InferenceServerException:
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
        timeout_s = self._timeout_s()
        refusal = self.breaker.before_call(f"{self.settings.model}/ModelInfer")
        if refusal is not None:
            raise local_error(refusal)
        started = time.monotonic()
        span, headers = self._start_span("ModelInfer")
        code = grpc.StatusCode.CANCELLED  # unless the call ends otherwise
        try:
            result = await self._client.infer(
                self.settings.model,
                [_tensor(name, array) for name, array in inputs.items()],
                model_version=self.settings.version,
                outputs=[triton_grpc.InferRequestedOutput(name) for name in outputs],
                client_timeout=timeout_s,
                headers=headers,
            )
            code = grpc.StatusCode.OK
        except InferenceServerException as error:
            code = _code(error)
            raise self._mesh_error(code, error.message()) from None
        except Exception:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            # Recorded however the call ends: a half-open breaker's trial slot must come
            # back even from a cancelled call.
            self._finish(span, code, time.monotonic() - started, timeout_s, streaming=False)
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
        cancels the request with it. One request per stream: the asyncio client cannot ask
        for Triton's empty final response, so `final` marks the end, and the request side
        stays open until then (half-closing it early would end the stream on Triton's side).
        """
        timeout_s = self._timeout_s()
        refusal = self.breaker.before_call(f"{self.settings.model}/ModelStreamInfer")
        if refusal is not None:
            raise local_error(refusal)
        started = time.monotonic()
        answered = asyncio.Event()

        async def request() -> AsyncIterator[dict]:
            yield {
                "model_name": self.settings.model,
                "model_version": self.settings.version,
                "request_id": request_id,
                "inputs": [_tensor(name, array) for name, array in inputs.items()],
                "outputs": [triton_grpc.InferRequestedOutput(name) for name in outputs],
            }
            await answered.wait()

        span, headers = self._start_span("ModelStreamInfer")
        responses = self._client.stream_infer(request(), stream_timeout=timeout_s, headers=headers)
        code = grpc.StatusCode.CANCELLED
        try:
            async for result, error in responses:
                if error is not None:
                    code = grpc.StatusCode.INTERNAL
                    raise self._mesh_error(code, error.message())
                response = {name: result.as_numpy(name) for name in outputs}
                if response[final] is not None:
                    code = grpc.StatusCode.OK
                    yield response
                    return
                yield response
            code = grpc.StatusCode.INTERNAL
            raise self._mesh_error(code, "the stream ended before its final response")
        except grpc.aio.AioRpcError as error:
            code = error.code()
            raise self._mesh_error(code, error.details() or "") from None
        finally:
            answered.set()
            responses.cancel()
            self._finish(span, code, time.monotonic() - started, timeout_s, streaming=True)

    async def close(self) -> None:
        await self._client.close()

    def _start_span(self, method: str) -> tuple[trace.Span, dict[str, str]]:
        """A client span for the call, and the headers that carry it to Triton: with its
        OpenTelemetry tracing on, Triton's own spans join the caller's trace. Not made the
        current span, as a stream's span outlives the context it started in."""
        span = _TRACER.start_span(
            f"/{_TRITON_SERVICE}/{method}",
            kind=trace.SpanKind.CLIENT,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": _TRITON_SERVICE,
                "rpc.method": method,
                "server.address": self.settings.url,
                "triton.model": self.settings.model,
                "triton.model_version": self.settings.version,
            },
        )
        headers: dict[str, str] = {}
        propagate.inject(headers, context=trace.set_span_in_context(span))
        return span, headers

    def _finish(
        self,
        span: trace.Span,
        code: grpc.StatusCode,
        duration_s: float,
        timeout_s: float,
        *,
        streaming: bool,
    ) -> None:
        self.breaker.record_status(code, None, duration_s, timeout_s, streaming=streaming)
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
        span.end()

    def _timeout_s(self) -> float:
        left = deadline.remaining()
        if left is not None and left <= 0:
            raise local_error(
                status(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no time left to call Triton at {self.settings.url}",
                    reason="BUDGET_SPENT",
                )
            )
        return self.settings.timeout_s if left is None else min(left, self.settings.timeout_s)

    def _mesh_error(self, code: grpc.StatusCode, message: str) -> Exception:
        where = f"Triton at {self.settings.url}, model {self.settings.model!r}: {message}"
        if code in _NOT_READY:
            return NotReady(where, reason="TRITON_UNAVAILABLE")
        if code in _PASSED_THROUGH:
            return local_error(status(code, where, reason=f"TRITON_{code.name}"))
        return RuntimeError(f"{where} ({code.name})")


def _path(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _tensor(name: str, array: np.ndarray) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def _code(error: InferenceServerException) -> grpc.StatusCode:
    """tritonclient reports a status as the string 'StatusCode.NAME', or None."""
    name = (error.status() or "").removeprefix("StatusCode.")
    return grpc.StatusCode.__members__.get(name, grpc.StatusCode.UNKNOWN)
