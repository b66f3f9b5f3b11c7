"""The request body, read whole by the gateway itself before any route sees it: at most
`max_body_bytes`, all of it within `body_read_timeout_s` of the request's arrival.

Envoy caps bodies in front, but the gateway may be reached without it (its own port, a
sidecar, a test), and FastAPI would read any body whole, however large or slow. Here a
Content-Length past the cap is refused (413) before a byte of the body is read, a chunked
body once it grows past the cap (413), a body still arriving at the deadline (408). Each
refusal is in OpenAI's shape, sent whole at once, and closes the connection
(`connection: close`): nothing more of that body is kept, and a client that trickles
holds no connection for a next request. Before a 413 closes it, the connection drops
what the client is still sending for at most LINGER_S (nginx's lingering close): most
clients write their whole body before they read, and would otherwise meet a reset
connection instead of the 413 (and the openai SDK would send it all again).

Every gateway route takes a JSON body or none, so reading it up front costs nothing a
route would not spend; the route then reads it from memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.types import Message, Receive, Send

from services.gateway.errors import ApiError

CLOSE = {"connection": "close"}
# How long a connection refused for its body's size still drops what its client sends
# before it is closed (nginx lingers up to 30 s; a body a client sends faster than the
# cap's worth a second is one a client on a fast link meant to send).
LINGER_S = 1.0


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int
    read_timeout_s: float


class ClientGone(Exception):
    """The client went away before its body was complete: there is nobody to answer."""


class BodyRefused(Exception):
    """A body refused before it was read whole; `still_sending`: its client may still be
    writing it."""

    def __init__(self, error: ApiError, *, still_sending: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.still_sending = still_sending

    async def answer(self, receive: Receive, send: Send) -> None:
        """The refusal, whole and at once; then, while the client may still be sending,
        what it sends dropped for up to LINGER_S; then the end of the response, upon
        which the server closes the connection."""
        response = self.error.response()
        start = {"status": response.status_code, "headers": response.raw_headers}
        await send({"type": "http.response.start", **start})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        if self.still_sending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LINGER_S):
                    while (await receive()).get("more_body", False):
                        pass
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def too_large(limits: BodyLimits, *, still_sending: bool = True) -> BodyRefused:
    error = ApiError(
        413,
        f"the request body is larger than this server takes ({limits.max_bytes} bytes)",
        type="invalid_request_error",
        code="request_too_large",
        headers=CLOSE,
    )
    return BodyRefused(error, still_sending=still_sending)


def too_slow(limits: BodyLimits) -> BodyRefused:
    error = ApiError(
        408,
        f"the request body did not arrive within {limits.read_timeout_s:g} s",
        type="invalid_request_error",
        code="request_timeout",
        headers=CLOSE,
    )
    return BodyRefused(error, still_sending=False)


def declared_length(headers: Mapping[str, str]) -> int | None:
    """Content-Length as a number (the HTTP parser has refused a malformed one)."""
    value = headers.get("content-length", "").strip()
    return int(value) if value.isascii() and value.isdigit() else None


async def read_body(
    headers: Mapping[str, str], receive: Receive, limits: BodyLimits
) -> tuple[bytes, Receive]:
    """Reads the whole body within `limits` (or raises BodyRefused, or ClientGone) and
    returns it, with a receive that gives it in one message, then passes through to
    `receive` (for the disconnect a response listens for)."""
    declared = declared_length(headers)
    if declared is not None and declared > limits.max_bytes:
        # A client that asked to be told to go on (Expect: 100-continue) sends nothing
        # until told; one that did not is sending now.
        waiting = headers.get("expect", "").strip().lower() == "100-continue"
        raise too_large(limits, still_sending=not waiting)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limits.max_bytes:
                    raise too_large(limits)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise too_slow(limits) from None
    whole = b"".join(chunks)
    body: Message | None = {"type": "http.request", "body": whole, "more_body": False}

    async def replay() -> Message:
        nonlocal body
        if body is None:
            return await receive()
        message, body = body, None
        return message

    return whole, replay
