"""The gateway's HTTP requests take the process's compute slots (MeshServer.admission),
as gRPC calls do everywhere else: bounded concurrency and a bounded queue, and past
them a 429 with Retry-After at once. A slot is taken before the mesh is called, so a
request refused here has cost no tokenizing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from mesh.admission import Admission
from mesh.failures import Overloaded
from services.gateway.errors import ApiError, retry_headers


class Slots:
    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    @asynccontextmanager
    async def held(self, route: str, *, streaming: bool) -> AsyncIterator[None]:
        try:
            await self.admission.enter(route, streaming=streaming)
        except Overloaded as refused:
            raise ApiError(
                429,
                refused.message,
                type="rate_limit_error",
                code=refused.reason.lower(),
                headers=retry_headers(refused.retry_after_s),
            ) from None
        started = time.monotonic()
        try:
            yield
        finally:
            self.admission.leave(route, time.monotonic() - started)
