"""A response that runs its work while it listens for the client going away.

Uvicorn does not cancel a request's task when its client disconnects; the app only learns
it from `receive()` (and Starlette's BaseHTTPMiddleware hides even that, vLLM #10087).
So every model-backed endpoint returns a `Guarded` response: its work (the mesh call, then
the JSON body or the event stream) runs in a task of its own, beside a listener for
`http.disconnect`. A disconnect cancels the work, and with it the gRPC call, whose
cancellation travels down the mesh (router -> decode frees the slot at its next step).
The same holds before the first byte, while the request waits for its first token.

Every send has a timeout: a client that stops reading would otherwise keep its decode
slot while socket buffers fill; past the timeout it is treated as gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from services.gateway import metrics
from services.gateway.errors import ApiError

log = logging.getLogger(__name__)

SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    # Proxies (nginx, some ingresses) buffer responses unless told not to.
    "x-accel-buffering": "no",
}


class SlowClient(Exception):
    """A send did not complete within the send timeout."""


class Exchange:
    """The sending half of one response, for the work to write to."""

    def __init__(self, send: Send, send_timeout_s: float) -> None:
        self._send = send
        self._timeout_s = send_timeout_s
        self.started = False

    async def _out(self, message: Message) -> None:
        try:
            # asyncio.timeout, not wait_for: no task per streamed event.
            async with asyncio.timeout(self._timeout_s):
                await self._send(message)
        except TimeoutError:
            raise SlowClient(f"no progress sending for {self._timeout_s} s") from None

    async def _start(self, status: int, headers: Mapping[str, str]) -> None:
        self.started = True
        raw = [(key.encode(), value.encode()) for key, value in headers.items()]
        await self._out({"type": "http.response.start", "status": status, "headers": raw})

    async def whole(self, response: Response) -> None:
        """A complete response (JSON, or an error before anything was sent)."""
        await self._start(response.status_code, dict(response.headers))
        await self._out({"type": "http.response.body", "body": response.body})

    async def open_stream(self) -> None:
        await self._start(200, SSE_HEADERS)

    async def write(self, data: bytes) -> None:
        await self._out({"type": "http.response.body", "body": data, "more_body": True})

    async def close(self) -> None:
        await self._out({"type": "http.response.body", "body": b"", "more_body": False})


Work = Callable[[Exchange], Awaitable[None]]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Guarded(Response):
    """Runs `work(exchange)` until it ends or the client goes; an ApiError the work raises
    before it sent anything becomes the error response."""

    def __init__(self, work: Work, *, route: str, send_timeout_s: float) -> None:
        super().__init__()
        self.work = work
        self.route = route
        self.send_timeout_s = send_timeout_s

    async def _run(self, exchange: Exchange) -> None:
        try:
            await self.work(exchange)
        except ApiError as error:
            if exchange.started:
                raise
            await exchange.whole(error.response())
        except (SlowClient, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("unhandled error answering %s", self.route)
            if exchange.started:
                raise
            failure = ApiError(500, "internal error in the gateway", type="server_error")
            await exchange.whole(failure.response())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(send, self.send_timeout_s)
        worker = asyncio.create_task(self._run(exchange), name=f"gateway {self.route}")
        listener = asyncio.create_task(_disconnected(receive), name="disconnect listener")
        try:
            done, _ = await asyncio.wait({worker, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # this task cancelled too (a shutdown past its grace period)
            listener.cancel()
            if not worker.done():
                worker.cancel()
        if worker not in done:
            metrics.ABANDONED.labels(self.route, "disconnect").inc()
            # Its cleanup (the gRPC call's cancel) runs before the response ends.
            await asyncio.gather(worker, return_exceptions=True)
            return
        try:
            worker.result()
        except SlowClient as slow:
            metrics.ABANDONED.labels(self.route, "send_timeout").inc()
            log.warning(
                "client stopped reading; its request is cancelled", extra={"why": str(slow)}
            )
