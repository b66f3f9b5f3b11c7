"""Uvicorn inside a process that owns its own signals (a MeshServer, `aimesh up`): its
Server, as is, would install SIGTERM and SIGINT handlers of its own and take shutdown
away from the process it runs in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn


class EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """The process's own handlers stay; it stops this server with should_exit."""
        yield
