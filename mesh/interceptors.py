"""The mesh's server and client interceptors: every concern applied in one layer each.

Server, outermost first (after OpenTelemetry's span): request id and client -> deadline
-> metrics -> error table -> caller authorization -> admission -> handler. Client, after
OpenTelemetry: request id and client -> deadline -> circuit breaker -> the call.

Each concern lives in its own module (request_id, deadline, metrics, errors, admission,
breaker); they are composed here rather than registered as one interceptor each because
every grpc.aio interceptor layer costs a coroutine frame, a handler object or call
details per call, which on a 2-core machine measured as a third of the mesh's overhead
(docs/benchmarks.md). Wrapped handlers are cached per method for the same reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from mesh import caller, caller_token, deadline, request_id
from mesh.admission import Admission
from mesh.authz import Policy
from mesh.breaker import CircuitBreaker
from mesh.caller_token import TokenSigner
from mesh.deadline import DeadlinePolicy
from mesh.errors import fail, local_error
from mesh.failures import Failure, InvalidInput
from mesh.metrics import MethodMetrics
from mesh.rpc import (
    StreamBehavior,
    UnaryBehavior,
    carried,
    checked_stream,
    is_infrastructure,
    method_name,
    wrap_handler,
)


def checked(request: Any) -> Any:
    """The request, once it parsed: an unparsable one raises its InvalidInput here."""
    if isinstance(request, InvalidInput):
        raise request
    if hasattr(request, "__aiter__"):
        return checked_stream(request)
    return request


Gate = Callable[[], Failure | None]
Authorize = Callable[[grpc.aio.ServicerContext], None]


def _trust_every_caller(context: grpc.aio.ServicerContext) -> None:
    """No policy (plaintext): every caller may call every method."""


class MeshServerInterceptor(grpc.aio.ServerInterceptor):
    """Applies request id, deadline, metrics, errors, authorization and admission to every
    non-probe call.

    Methods in `exempt_methods` (cheap control calls such as GetLoad or Cancel) skip
    admission so they answer even when every compute slot is busy; health and reflection
    skip everything. `gate()` names why the process serves nothing now (its engine still
    loading, a background task dead), so no servicer needs a guard of its own. With a
    `policy` (mutual TLS), a caller must be on the method's allow-list (mesh/authz.py)
    before anything else looks at its request.
    """

    def __init__(
        self,
        admission: Admission,
        exempt_methods: Iterable[str],
        gate: Gate,
        policy: Policy | None = None,
    ) -> None:
        self.admission = admission
        self.exempt_methods = frozenset(exempt_methods)
        self.gate = gate
        self.policy = policy
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_infrastructure(method):
            return handler
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            admit = method not in self.exempt_methods
            metrics = MethodMetrics(method)
            authorize = self._authorizer(method)
            wrapped = wrap_handler(
                handler,
                lambda behavior: self._unary(behavior, method, metrics, admit, authorize),
                lambda behavior: self._stream(behavior, method, metrics, admit, authorize),
            )
            cached = self._wrapped[method] = (handler, wrapped)
        return cached[1]

    def _authorizer(self, method: str) -> Authorize:
        """The check of one method's callers, its allow-list looked up once."""
        policy = self.policy
        if policy is None:
            return _trust_every_caller
        allowed = policy.callers_of(method)
        identify = policy.identify
        return lambda context: policy.check(method, allowed, identify(context, method))

    def _unary(
        self,
        behavior: UnaryBehavior,
        method: str,
        metrics: MethodMetrics,
        admit: bool,
        authorize: Authorize,
    ) -> UnaryBehavior:
        admission = self.admission

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request_id.adopt(context)
            caller.adopt(context)
            deadline.record(context)
            started = metrics.started()
            error: BaseException | None = None
            try:
                admitted_at = None
                try:
                    authorize(context)
                    request = checked(request)
                    if refusal := self.gate():
                        raise refusal
                    if admit:
                        await admission.enter(method, streaming=False)
                        admitted_at = time.monotonic()
                    return await behavior(request, context)
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    await fail(context, exc, method)
                finally:
                    if admitted_at is not None:
                        admission.leave(method, time.monotonic() - admitted_at)
            except BaseException as exc:
                error = exc
                raise
            finally:
                metrics.finished(context, error, started)

        return handle

    def _stream(
        self,
        behavior: StreamBehavior,
        method: str,
        metrics: MethodMetrics,
        admit: bool,
        authorize: Authorize,
    ) -> StreamBehavior:
        admission = self.admission

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request_id.adopt(context)
            caller.adopt(context)
            deadline.record(context)
            started = metrics.started()
            error: BaseException | None = None
            sent = 0
            try:
                admitted_at = None
                try:
                    authorize(context)
                    request = checked(request)
                    if refusal := self.gate():
                        raise refusal
                    if admit:
                        await admission.enter(method, streaming=True)
                        admitted_at = time.monotonic()
                    async for response in behavior(request, context):
                        sent += 1
                        yield response
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    await fail(context, exc, method)
                finally:
                    if admitted_at is not None:
                        admission.leave(method, time.monotonic() - admitted_at)
            except BaseException as exc:
                error = exc
                raise
            finally:
                metrics.sent.inc(sent)
                metrics.finished(context, error, started)

        return handle


class MeshClientInterceptor:
    """Request id, deadline and circuit breaker for every call on one channel.

    Unary calls are awaited here, inside the interceptor task. Awaiting the call itself (not
    its code(), as the upstream tracing interceptor does, contrib #3271) is what lets grpc
    cancel the RPC when the caller's task is cancelled. Streams are observed through a
    done callback, so a long stream costs nothing per message.

    grpc.aio files each interceptor object under the first arity it subclasses (an elif
    chain in Channel.__init__), so a channel gets one of the subclasses below per arity
    (`client_interceptors`), sharing the policy and the breaker.
    """

    def __init__(
        self,
        deadlines: DeadlinePolicy,
        breaker: CircuitBreaker,
        tokens: TokenSigner | None = None,
    ) -> None:
        self.deadlines = deadlines
        self.breaker = breaker
        self.tokens = tokens
        self._observers: set[asyncio.Task[None]] = set()

    def _prepare(self, details: Any, *, streaming: bool) -> Any:
        timeout = self.deadlines.timeout_for(details, streaming=streaming)
        refusal = self.breaker.before_call(method_name(details))
        if refusal is not None:
            raise local_error(refusal)
        carry = {
            request_id.METADATA_KEY: request_id.current(),
            caller.METADATA_KEY: caller.current(),
        }
        if self.tokens is not None:
            carry[caller_token.METADATA_KEY] = self.tokens.token(method_name(details))
        metadata = carried(details.metadata, carry)
        return details._replace(timeout=timeout, metadata=metadata)

    async def _unary(self, continuation: Any, details: Any, request: Any) -> Any:
        details = self._prepare(details, streaming=False)
        started = time.monotonic()
        call = await continuation(details, request)
        try:
            await call
        except grpc.aio.AioRpcError as error:
            self._record(error.code(), error, started, details.timeout, streaming=False)
            return call
        except asyncio.CancelledError:
            self._record(grpc.StatusCode.CANCELLED, None, started, details.timeout, streaming=False)
            raise
        self._record(grpc.StatusCode.OK, None, started, details.timeout, streaming=False)
        return call

    async def _stream(self, continuation: Any, details: Any, request: Any) -> Any:
        details = self._prepare(details, streaming=True)
        started = time.monotonic()
        call = await continuation(details, request)

        def observe(done: Any) -> None:
            observation = self._observe(done, started, details.timeout)
            try:
                task = asyncio.ensure_future(observation)
            except RuntimeError:  # the event loop is already gone: nothing to record into
                observation.close()
                return
            self._observers.add(task)
            task.add_done_callback(self._observers.discard)

        call.add_done_callback(observe)
        return call

    async def _observe(self, call: Any, started: float, timeout_s: float) -> None:
        code = await call.code()
        error = None
        if code != grpc.StatusCode.OK:
            error = grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), await call.trailing_metadata(), await call.details()
            )
        self._record(code, error, started, timeout_s, streaming=True)

    def _record(
        self,
        code: grpc.StatusCode,
        error: grpc.aio.AioRpcError | None,
        started: float,
        timeout_s: float,
        *,
        streaming: bool,
    ) -> None:
        duration = time.monotonic() - started
        self.breaker.record_status(code, error, duration, timeout_s, streaming=streaming)

    intercept_unary_unary = _unary
    intercept_stream_unary = _unary
    intercept_unary_stream = _stream
    intercept_stream_stream = _stream


class _UnaryUnary(MeshClientInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    pass


class _UnaryStream(MeshClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    pass


class _StreamUnary(MeshClientInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    pass


class _StreamStream(MeshClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    pass


def client_interceptors(
    deadlines: DeadlinePolicy, breaker: CircuitBreaker, tokens: TokenSigner | None = None
) -> list[grpc.aio.ClientInterceptor]:
    return [
        arity(deadlines, breaker, tokens)
        for arity in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    ]
