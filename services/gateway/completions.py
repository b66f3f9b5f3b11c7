"""POST /v1/chat/completions and /v1/completions on the generation service's Chat and
Generate streams.

The router applies the chat template, validates sampling and stopping once and cuts stop
sequences; here the OpenAI request becomes its proto, the proto stream becomes OpenAI's
events or body, and the router's field paths become OpenAI's parameter names. A stream's
first message is awaited before the response starts, so a request the mesh refuses gets
its real status (400, 429, ...) rather than a 200 stream that ends in an error; after
that, a failure is an error event and then [DONE].

Each request is charged to its tenant's requests_per_minute here, the door it came in
by; its tokens are the generation router's to meter (mesh/metering.py): it reserves the
real prompt tokens plus the most the request may generate, and refuses a tenant past its
limits with RESOURCE_EXHAUSTED, which becomes OpenAI's 429 here.
"""

from __future__ import annotations

import string
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import grpc
from fastapi.responses import JSONResponse

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from mesh import caller, request_id
from services.gateway.errors import ApiError, from_rpc
from services.gateway.keys import Principal
from services.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from services.gateway.responses import Exchange, Guarded
from services.gateway.shared import Shared
from services.gateway.sse import DONE, ChatShape, TextShape, finish_reason, frame

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]

# OpenAI's default temperature (the proto's unset 0 would be greedy).
DEFAULT_TEMPERATURE = 1.0
# The router's field paths in OpenAI's words (mesh field -> parameter).
PARAMS = {
    "model": "model",
    "prompt": "prompt",
    "messages": "messages",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.seed": "seed",
    "sampling.frequency_penalty": "frequency_penalty",
    "stopping.stop_sequences": "stop",
}
# "developer" is OpenAI's newer "system"; the chat template knows "system".
ROLES = {"developer": "system"}
# Printable ASCII but '%', kept as it is in the x-aimesh-user metadata.
_PRINTABLE = "".join(c for c in string.printable if c.isprintable() and c != "%")


def _unfinished() -> ApiError:
    """The router ends every stream that did not fail with a `complete` message."""
    return ApiError(502, "the generation stream ended without its result", type="server_error")


Shape = ChatShape | TextShape
Body = ChatCompletionRequest | CompletionRequest


def sampling(body: Body) -> sampling_pb2.SamplingParameters:
    message = sampling_pb2.SamplingParameters(
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        frequency_penalty=body.frequency_penalty or 0.0,
    )
    if body.top_p is not None:
        message.top_p = body.top_p
    if body.seed is not None:
        message.seed = body.seed
    return message


def stopping(body: Body) -> sampling_pb2.StoppingCriteria:
    message = sampling_pb2.StoppingCriteria(stop_sequences=body.stop_sequences())
    length = body.length()
    if length is not None:
        message.max_new_tokens = length[1]
    return message


def params_of(body: Body) -> dict[str, str]:
    """PARAMS, with the length limit named as this request named it."""
    length = body.length()
    return {**PARAMS, "stopping.max_new_tokens": length[0] if length else "max_tokens"}


def chat_request(body: ChatCompletionRequest) -> generation_pb2.ChatRequest:
    return generation_pb2.ChatRequest(
        request_id=request_id.current(),
        messages=[
            common_pb2.ChatMessage(role=ROLES.get(m.role, m.role), content=m.text())
            for m in body.messages
        ],
        sampling=sampling(body),
        stopping=stopping(body),
        model=body.model,
        cache_salt=body.cache_salt or "",
    )


def completion_request(body: CompletionRequest) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id.current(),
        prompt=body.text(),
        sampling=sampling(body),
        stopping=stopping(body),
        model=body.model,
        cache_salt=body.cache_salt or "",
    )


@dataclass
class _Run:
    """One completion: the call to make, and how to answer it."""

    call: Any
    body: Body
    shape: Shape
    params: dict[str, str]


class Completions:
    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub, shared: Shared) -> None:
        self.stub = stub
        self.shared = shared

    def _check(self, body: Body) -> None:
        body.refuse_unsupported()
        self.shared.catalog.require("chat", body.model)

    def chat(self, body: ChatCompletionRequest, principal: Principal) -> Guarded:
        self._check(body)
        request = chat_request(body)
        shape = ChatShape(body.model, int(time.time()), body.include_usage)
        return self._guarded(
            "/v1/chat/completions", self.stub.Chat, request, body, shape, principal
        )

    def completion(self, body: CompletionRequest, principal: Principal) -> Guarded:
        self._check(body)
        request = completion_request(body)
        shape = TextShape(body.model, int(time.time()), body.include_usage)
        return self._guarded("/v1/completions", self.stub.Generate, request, body, shape, principal)

    def _guarded(
        self,
        route: str,
        method: Any,
        request: Any,
        body: Body,
        shape: Shape,
        who: Principal,
    ) -> Guarded:
        async def work(exchange: Exchange) -> None:
            async with self.shared.admitted(who, route, model=None, streaming=body.stream):
                call = method(request, metadata=_metadata(who, body))
                run = _Run(call, body, shape, params_of(body))
                try:
                    if body.stream:
                        await _stream(exchange, run)
                    else:
                        await _whole(exchange, run)
                finally:
                    call.cancel()  # a no-op once the call ended; else decode stops now

        return Guarded(work, route=route, send_timeout_s=self.shared.send_timeout_s)


def _metadata(who: Principal, body: Body) -> tuple[tuple[str, str], ...]:
    """The client, and the end user when the body names one (percent-encoded where it
    is not printable ASCII, which metadata must be; the same user always the same)."""
    metadata = ((caller.METADATA_KEY, who.tenant),)
    if body.user:
        metadata += ((caller.USER_METADATA_KEY, quote(body.user, safe=_PRINTABLE)),)
    return metadata


async def _whole(exchange: Exchange, run: _Run) -> None:
    text: list[str] = []
    complete = None
    try:
        async for message in run.call:
            if message.HasField("chunk"):
                text.append(message.chunk.text)
            else:
                complete = message.complete
    except grpc.aio.AioRpcError as error:
        raise from_rpc(error, run.params) from None
    if complete is None:
        raise _unfinished()
    run.shape.fingerprint = complete.model_version or None
    body = run.shape.whole("".join(text), finish_reason(complete.finish_reason), complete.usage)
    await exchange.whole(JSONResponse(body))


async def _next(messages: AsyncIterator[Any]) -> Any | None:
    return await anext(messages, None)


async def _stream(exchange: Exchange, run: _Run) -> None:
    messages = aiter(run.call)
    try:
        message = await _next(messages)
    except grpc.aio.AioRpcError as error:
        raise from_rpc(error, run.params) from None
    await exchange.open_stream()
    shape = run.shape
    opening = shape.opening()
    if opening is not None:
        await exchange.write(frame(opening))
    complete = None
    try:
        while message is not None:
            if message.HasField("chunk"):
                if message.chunk.text:
                    await exchange.write(frame(shape.text_event(message.chunk.text)))
            else:
                complete = message.complete
            message = await _next(messages)
    except grpc.aio.AioRpcError as error:
        await exchange.write(frame(from_rpc(error, run.params).body()))
    else:
        if complete is None:
            await exchange.write(frame(_unfinished().body()))
        else:
            shape.fingerprint = complete.model_version or None
            await exchange.write(frame(shape.finish_event(finish_reason(complete.finish_reason))))
            if shape.include_usage:
                await exchange.write(frame(shape.usage_event(complete.usage)))
    await exchange.write(DONE)
    await exchange.close()
