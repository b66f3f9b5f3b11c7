"""What every HTTP request passes before its endpoint, as one pure ASGI layer (no
BaseHTTPMiddleware: it hides client disconnects, vLLM #10087):

request id (`x-request-id`, taken when valid, else made, echoed on the response) -> an
OpenTelemetry server span joining the caller's `traceparent`, so the mesh calls below are
its children -> the request's deadline budget, shared by every hop -> the API key and its
scope -> the body, read whole within its size cap and deadline (request_body.py) ->
metrics by route and status. The key is read from the header, hashed and dropped;
nothing here logs headers.

Whatever escapes the app is answered here, in OpenAI's shape (a 500 naming the request
id) while no response has started; the client then always gets a JSON error, never
Starlette's or uvicorn's plain-text one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mesh import deadline, request_id
from mesh.keys import bearer_key
from services.gateway import metrics
from services.gateway.errors import ApiError, internal
from services.gateway.keys import KeyStore, OpenAccess
from services.gateway.request_body import BodyLimits, BodyRefused, ClientGone, read_body

# Answered without a key: probes and scrapers carry none (vLLM and llama.cpp alike).
PUBLIC = frozenset({"/health", "/health/live", "/health/ready", "/metrics"})
# The scope each path needs; any other path needs a valid key of any scope.
SCOPES = {
    "/v1/chat/completions": "generate",
    "/v1/completions": "generate",
    "/v1/responses": "generate",
    "/v1/embeddings": "embed",
    "/v1/rerank": "embed",
    "/v1/images/generations": "images",
}
PRINCIPAL = "aimesh.principal"
# The request's whole body, for an endpoint that must look at it before its framework
# reads it (MCP's method decides the scope a key needs).
BODY = "aimesh.body"
# The status counted for a request whose client left before its body was complete
# (nginx's "client closed request").
CLIENT_GONE = 499

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("aimesh.gateway")


def new_id() -> str:
    """A request id for a request that brought none (the mesh's own form)."""
    return os.urandom(16).hex()


def _authorize(keys: KeyStore | OpenAccess, path: str, headers: Mapping[str, str]):
    principal = keys.lookup(bearer_key(headers))
    if principal is None:
        raise ApiError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>`",
            type="authentication_error",
            code="invalid_api_key",
        )
    needed = SCOPES.get(path)
    if needed is not None and needed not in principal.scopes:
        raise missing_scope(path, needed)
    return principal


def missing_scope(what: str, needed: str) -> ApiError:
    """The 403 for a key whose tenant lacks the scope `what` (a path, an MCP method)
    needs."""
    return ApiError(
        403,
        f"this key's tenant may not use {what} (it needs the {needed!r} scope)",
        type="permission_error",
        code="missing_scope",
    )


def _route(scope: Scope, path: str) -> str:
    """A bounded label for the request: the matched route's template, the path of a
    known route refused before routing (a bad key), else 'unmatched'."""
    route = getattr(scope.get("route"), "path", None)
    if route is not None:
        return route
    return path if path in PUBLIC or path in SCOPES else "unmatched"


class Front:
    def __init__(
        self, app: ASGIApp, keys: KeyStore | OpenAccess, budget_s: float, body: BodyLimits
    ) -> None:
        self.app = app
        self.keys = keys
        self.budget_s = budget_s
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get(request_id.METADATA_KEY, "")
        rid = request_id.ensure(given if given and request_id.is_valid(given) else new_id())
        status = 500
        responded = finished = False
        started = time.perf_counter()

        async def observed(message: Message) -> None:
            nonlocal status, responded, finished
            if message["type"] == "http.response.start":
                status = message["status"]
                responded = True
                message["headers"] = [
                    *message.get("headers", []),
                    (request_id.METADATA_KEY.encode(), rid.encode()),
                ]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        path = scope["path"]
        with (
            _tracer.start_as_current_span(
                f"{scope['method']} {path}",
                context=propagate.extract(headers),
                kind=SpanKind.SERVER,
                attributes={"http.request.method": scope["method"], "url.path": path},
            ) as span,
            deadline.budget(self.budget_s),
        ):
            try:
                if path not in PUBLIC:
                    scope[PRINCIPAL] = _authorize(self.keys, path, headers)
                scope[BODY], receive = await read_body(headers, receive, self.body)
                await self.app(scope, receive, observed)
            except ClientGone:
                status = CLIENT_GONE
            except BodyRefused as refused:
                await refused.answer(receive, observed)
            except ApiError as refused:
                if responded:
                    raise
                await refused.response()(scope, receive, observed)
            except Exception:
                log.exception("unhandled error answering %s %s", scope["method"], path)
                if not responded:
                    await internal().response()(scope, receive, observed)
                elif not finished:
                    raise  # the server cuts the connection: the client sees a broken answer
            finally:
                route = _route(scope, path)
                span.update_name(f"{scope['method']} {route}")
                span.set_attribute("http.response.status_code", status)
                metrics.REQUESTS.labels(route, str(status)).inc()
                metrics.LATENCY.labels(route).observe(time.perf_counter() - started)
