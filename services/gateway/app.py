"""The HTTP API: FastAPI routes over the completions, embeddings, images, rerank and
catalog handlers, behind the Front layer (request id, span, budget, key, body limits,
metrics), with every error in OpenAI's shape: refusals, validation, unknown routes and
methods (404, 405), a body sent as anything but JSON (415), and, last, the gateway's own
failures (500). FastAPI/Starlette on uvicorn (httptools) is what vLLM, SGLang and Triton's
OpenAI frontend run: pydantic request models, and an ASGI server whose disconnects reach
the app."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from mesh.failures import Failure
from mesh.metering import Meter
from services.gateway import responses_api
from services.gateway.catalog import Catalog
from services.gateway.completions import Completions
from services.gateway.embeddings import Embeddings
from services.gateway.errors import ApiError, from_validation, internal, model_not_found
from services.gateway.front import PRINCIPAL, Front
from services.gateway.images import Images
from services.gateway.keys import KeyStore, OpenAccess, Principal
from services.gateway.mcp_http import PATH as MCP_PATH
from services.gateway.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ImageRequest,
    RerankRequest,
    ResponsesRequest,
)
from services.gateway.request_body import BodyLimits
from services.gateway.rerank import Rerank
from services.gateway.shared import refusal

_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def _principal(request: Request) -> Principal:
    return request.scope[PRINCIPAL]


def json_body(request: Request) -> None:
    """415 for a body sent as anything but JSON (curl -d sends a form), as vLLM answers;
    FastAPI would otherwise read it as bytes and fail the model's validation."""
    content_type = request.headers.get("content-type", "")
    media = content_type.partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(
            415,
            f"the body must be JSON (content-type: application/json), not {media or 'untyped'}",
            type="invalid_request_error",
            code="unsupported_media_type",
        )


def build_app(
    *,
    completions: Completions,
    embeddings: Embeddings,
    images: Images,
    rerank: Rerank,
    catalog: Catalog,
    keys: KeyStore | OpenAccess,
    meter: Meter,
    budget_s: float,
    body: BodyLimits,
    ready: Callable[[], bool],
    mcp: ASGIApp,
) -> ASGIApp:
    """The whole ASGI app; `ready()` says whether the gateway can serve now; `mcp`
    answers MCP's Streamable HTTP at its path (mcp_http.py)."""
    app = FastAPI(
        title="aimesh gateway",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # Front owns the request's span and metrics; FastAPI's own would be a second span
        # per request and one more wrapper around every streamed event's send.
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        return from_validation(error.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        kind = _HTTP_TYPES.get(error.status_code, "invalid_request_error")
        return ApiError(
            error.status_code, str(error.detail), type=kind, headers=error.headers
        ).response()

    @app.exception_handler(Exception)
    async def failure(request: Request, error: Exception) -> JSONResponse:
        """Starlette answers with this, then raises the error on to Front, which logs it."""
        return internal().response()

    json_only = [Depends(json_body)]

    @app.post("/v1/chat/completions", dependencies=json_only)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return completions.chat(body, _principal(request))

    @app.post("/v1/responses", dependencies=json_only)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return responses_api.respond(completions, body, _principal(request))

    @app.post("/v1/completions", dependencies=json_only)
    async def text_completions(body: CompletionRequest, request: Request) -> Response:
        return completions.completion(body, _principal(request))

    @app.post("/v1/embeddings", dependencies=json_only)
    async def embed(body: EmbeddingRequest, request: Request) -> Response:
        return embeddings.embed(body, _principal(request))

    @app.post("/v1/images/generations", dependencies=json_only)
    async def generate_images(body: ImageRequest, request: Request) -> Response:
        return images.generate(body, _principal(request))

    @app.post("/v1/rerank", dependencies=json_only)
    async def rerank_documents(body: RerankRequest, request: Request) -> Response:
        return rerank.rerank(body, _principal(request))

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": catalog.as_openai()}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, object]:
        for entry in catalog.as_openai():
            if entry["id"] == model:
                return entry
        raise model_not_found(model, [str(entry["id"]) for entry in catalog.as_openai()])

    @app.get("/v1/usage")
    async def usage(request: Request) -> dict[str, object]:
        """The ledger: an `admin` key sees every tenant, any other key its own."""
        principal = _principal(request)
        try:
            rows = await meter.usage()
        except Failure as failed:
            raise refusal(failed) from None
        everyone = "admin" in principal.scopes
        data = [
            {"tenant": tenant, "model": model, **counts}
            for (tenant, model), counts in sorted(rows.items())
            if everyone or tenant == principal.tenant
        ]
        return {"object": "list", "data": data}

    # MCP's transport answers its own methods (POST messages, GET a stream where a
    # revision has one, DELETE a session) and its own errors, in JSON-RPC's shape.
    app.router.add_route(MCP_PATH, mcp, methods=["GET", "POST", "DELETE"])

    @app.get("/health/live")
    async def live() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health")
    @app.get("/health/ready")
    async def health() -> JSONResponse:
        if ready():
            return JSONResponse({"status": "ok"})
        return ApiError(
            503, "not ready: a dependency is not serving", type="service_unavailable_error"
        ).response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return Front(app, keys, budget_s, body)
