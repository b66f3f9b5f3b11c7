"""Uvicorn serving the app inside the mesh server's own event loop, so the HTTP requests
and the mesh channels they call share one loop (grpc.aio channels belong to the loop
they were made in) and the process has one lifecycle: MeshServer owns SIGTERM, and the
HTTP side drains in its shutdown hook, within the service's grace period."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from mesh.config import TlsSettings
from mesh.embedded_http import EmbeddedServer
from mesh.tls import terminates_here

log = logging.getLogger(__name__)


def _tls_options(tls: TlsSettings | None) -> dict[str, Any]:
    """uvicorn's TLS settings from the mesh's `[tls]`: its certificate, and callers'
    certificates required and checked against the mesh CA (the edge's, under mTLS); none
    where a sidecar terminates TLS (the edge's keys still gate this API)."""
    if tls is None or not terminates_here(tls):
        return {}
    return {
        "ssl_certfile": str(tls.cert_file),
        "ssl_keyfile": str(tls.key_file),
        "ssl_ca_certs": str(tls.ca_file),
        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE,
    }


class HttpServer:
    def __init__(
        self, app: ASGIApp, host: str, port: int, grace_s: float, tls: TlsSettings | None = None
    ) -> None:
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http="httptools",
            ws="none",
            lifespan="off",
            # Logs go through the process's JSON handler; an access log would add nothing
            # the metrics and spans lack.
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=grace_s,
            **_tls_options(tls),
        )
        self.server = EmbeddedServer(self.config)
        self.port = 0
        self.draining = False
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> asyncio.Task[None]:
        """Binds now (the port is known at once, also when 0 was asked for) and serves
        in a task, which the caller should watch."""
        # Bound here rather than by uvicorn, whose bind_socket exits the process on failure.
        # IPPROTO_TCP named, as uvicorn does: asyncio sets TCP_NODELAY on accepted sockets
        # only when their proto says TCP, and without it a response's header and body
        # writes meet the client's delayed ACK (+40 ms per request on a kept-alive
        # connection, measured).
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.config.host, self.config.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]), name="http")
        log.info("http listening", extra={"address": f"{self.config.host}:{self.port}"})
        return self.task

    async def stop(self) -> None:
        """Stops accepting, lets requests in flight finish within the grace period."""
        self.draining = True
        if self.task is not None:
            self.server.should_exit = True
            await self.task
