"""The gateway process: a MeshServer (gRPC health, GetInfo, metrics, JSON logs, drain)
that also serves the OpenAI HTTP API, calling generation and the embedder through its
mesh channels (trace, request id, deadline, breaker), diffusion for images and rerank for
/v1/rerank.

Liveness answers as soon as the process listens, the HTTP /health/live too; readiness
(gRPC and /health/ready) waits until every dependency is ready and has said which
models it serves, then follows them (a dependency down makes the gateway unready).
"""

from __future__ import annotations

import asyncio
import logging

from aimesh.diffusion.v1 import diffusion_pb2_grpc
from aimesh.llm.v1 import generation_pb2_grpc
from aimesh.rerank.v1 import rerank_pb2_grpc
from aimesh.retrieval.v1 import embedder_pb2_grpc
from aimesh.tools.v1 import tools_pb2_grpc
from mesh.metering import Meter, warn_unenforced
from mesh.server import MeshServer
from services.gateway.admission import Slots
from services.gateway.app import build_app
from services.gateway.catalog import SURFACES, Catalog
from services.gateway.completions import GENERATION, Completions
from services.gateway.embeddings import EMBEDDER, Embeddings
from services.gateway.http_server import HttpServer
from services.gateway.images import DIFFUSION, Images
from services.gateway.keys import KeyStore, OpenAccess
from services.gateway.mcp_http import McpEndpoint
from services.gateway.mcp_server import TOOLS
from services.gateway.request_body import BodyLimits
from services.gateway.rerank import RERANK, Rerank
from services.gateway.settings import GatewayOptions
from services.gateway.shared import Shared

log = logging.getLogger(__name__)


async def setup(server: MeshServer) -> HttpServer:
    options = server.options_as(GatewayOptions)
    catalog = Catalog(
        {name: server.dependency_target(name) for name in SURFACES}, server.settings.tls
    )
    slots = Slots(server.admission)
    meter = Meter.from_settings(server.settings.limits, server.settings.cache_dir)
    shared = Shared(catalog, slots, meter, options.send_timeout_s)
    completions = Completions(
        generation_pb2_grpc.GenerationServiceStub(server.channel_to("generation", GENERATION)),
        shared,
    )
    embeddings = Embeddings(
        embedder_pb2_grpc.EmbedderServiceStub(server.channel_to("embedder", EMBEDDER)), shared
    )
    images = Images(
        diffusion_pb2_grpc.DiffusionServiceStub(server.channel_to("diffusion", DIFFUSION)), shared
    )
    rerank = Rerank(rerank_pb2_grpc.RerankServiceStub(server.channel_to("rerank", RERANK)), shared)
    if options.api_keys_file is None:
        log.warning("no api_keys_file: every HTTP caller is the tenant 'anonymous'")
        keys: KeyStore | OpenAccess = OpenAccess()
    else:
        keys = KeyStore(options.api_keys_file)
        warn_unenforced(options.api_keys_file, server.settings.limits)
    mcp = McpEndpoint(
        tools_pb2_grpc.ToolsServiceStub(server.channel_to("tools", TOOLS)),
        call_timeout_s=options.request_timeout_s,
        allowed_hosts=options.mcp_allowed_hosts,
        allowed_origins=options.mcp_allowed_origins,
    )
    service = server.settings.service(server.name)
    http = HttpServer(
        build_app(
            completions=completions,
            embeddings=embeddings,
            images=images,
            rerank=rerank,
            catalog=catalog,
            keys=keys,
            meter=meter,
            budget_s=options.request_timeout_s,
            body=BodyLimits(options.max_body_bytes, options.body_read_timeout_s),
            ready=lambda: catalog.ready and not http.draining,
            mcp=mcp,
        ),
        service.host,
        options.http_port,
        service.grace_s,
        server.settings.tls,
    )

    async def listen() -> None:
        server.watch(mcp.start())
        server.watch(await http.start())

    async def wait_for_dependencies() -> None:
        while not await catalog.refresh():  # noqa: ASYNC110
            await asyncio.sleep(options.poll_interval_s)

    server.add_warmup(listen)
    server.add_warmup(wait_for_dependencies)
    server.add_readiness_probe(catalog.refresh)
    server.add_shutdown(http.stop)
    server.add_shutdown(mcp.stop)
    server.add_shutdown(meter.close)
    return http
