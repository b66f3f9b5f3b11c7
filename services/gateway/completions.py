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

import asyncio
import json
import logging
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
from services.gateway.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    ResponsesNamedFunction,
)
from services.gateway.responses import Exchange, Guarded
from services.gateway.shared import Shared
from services.gateway.sse import (
    DONE,
    ChatShape,
    Output,
    TextShape,
    finish_reason,
    frame,
    summed_usage,
)

log = logging.getLogger(__name__)

GENERATION = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]

# SamplingParameters.seed is a uint64: choice i's seed + i wraps below this.
MAX_SEED_EXCLUSIVE = 2**64
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
    "sampling.logprobs": "logprobs",
    "sampling.top_logprobs": "top_logprobs",
    "sampling.frequency_penalty": "frequency_penalty",
    "stopping.stop_sequences": "stop",
    "sampling.constraint": "response_format",
    "sampling.constraint.json_schema": "response_format.json_schema.schema",
    "tool_choice.function": "tool_choice.function.name",
}
# "developer" is OpenAI's newer "system"; the chat template knows "system".
ROLES = {"developer": "system"}
TOOL_CHOICE_MODES = {
    "auto": generation_pb2.ToolChoice.MODE_AUTO,
    "none": generation_pb2.ToolChoice.MODE_NONE,
    "required": generation_pb2.ToolChoice.MODE_REQUIRED,
}
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
    if (alternatives := body.alternatives()) is not None:
        message.logprobs = True
        message.top_logprobs = alternatives
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


def output_constraint(
    kind: str | None, schema: dict[str, Any] | None
) -> sampling_pb2.OutputConstraint | None:
    """An output format (chat's response_format, the Responses API's text.format) as the
    constraint the engines enforce; None for plain text. A json_schema without its
    schema is any JSON object."""
    if kind in (None, "text"):
        return None
    if schema is None:
        return sampling_pb2.OutputConstraint(json_object=True)
    return sampling_pb2.OutputConstraint(json_schema=json.dumps(schema))


def tool_definition(
    name: str, description: str | None, parameters: dict[str, Any] | None
) -> generation_pb2.ToolDefinition:
    return generation_pb2.ToolDefinition(
        name=name,
        description=description or "",
        parameters=json.dumps(parameters) if parameters else "",
    )


def choose_tools(
    request: generation_pb2.ChatRequest,
    choice: str | NamedToolChoice | ResponsesNamedFunction | None,
    parallel: bool | None,
) -> None:
    """tool_choice (a mode, or the function named) and parallel_tool_calls, where given."""
    if isinstance(choice, str):
        request.tool_choice.mode = TOOL_CHOICE_MODES[choice]
    elif choice is not None:
        request.tool_choice.function = choice.name
    if parallel is not None:
        request.parallel_tool_calls = parallel


def _message(message: ChatMessage) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(
        role=ROLES.get(message.role, message.role),
        content=message.text(),
        tool_calls=[
            common_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in message.tool_calls or []
        ],
        tool_call_id=message.tool_call_id or "",
    )


def chat_request(body: ChatCompletionRequest) -> generation_pb2.ChatRequest:
    chat_sampling = sampling(body)
    form = body.response_format
    kind = form.type if form is not None else None
    schema = form.json_schema.schema_ if form is not None and form.json_schema else None
    if (output := output_constraint(kind, schema)) is not None:
        chat_sampling.constraint.CopyFrom(output)
    request = generation_pb2.ChatRequest(
        request_id=request_id.current(),
        messages=[_message(m) for m in body.messages],
        sampling=chat_sampling,
        stopping=stopping(body),
        model=body.model,
        cache_salt=body.cache_salt or "",
        tools=[
            tool_definition(t.function.name, t.function.description, t.function.parameters)
            for t in body.tools or []
        ],
    )
    choose_tools(request, body.tool_choice, body.parallel_tool_calls)
    return request


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
    """One completion: its calls (one a choice, n of them), and how to answer it."""

    calls: list[Any]
    body: Body
    shape: Shape
    params: dict[str, str]


def choices_of(request: Any, n: int) -> list[Any]:
    """The request once a choice. Choice i samples with seed + i when a seed is given
    (so n seeded choices differ and each reproduces), else with the fresh seed the router
    gives each generation; the prompt's KV is computed for the first and found in the
    prefix cache by the rest."""
    if n == 1:
        return [request]
    copies = []
    for index in range(n):
        copy = type(request)()
        copy.CopyFrom(request)
        if request.sampling.HasField("seed"):
            copy.sampling.seed = (request.sampling.seed + index) % MAX_SEED_EXCLUSIVE
        copies.append(copy)
    return copies


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
        shape = ChatShape(
            body.model, int(time.time()), body.include_usage, logprobs=body.logprobs is True
        )
        return self._guarded(
            "/v1/chat/completions", self.stub.Chat, request, body, shape, principal
        )

    def completion(self, body: CompletionRequest, principal: Principal) -> Guarded:
        self._check(body)
        request = completion_request(body)
        shape = TextShape(
            body.model, int(time.time()), body.include_usage, logprobs=body.logprobs is not None
        )
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
                metadata = metadata_of(who, body.user)
                calls = [method(r, metadata=metadata) for r in choices_of(request, body.n or 1)]
                run = _Run(calls, body, shape, params_of(body))
                try:
                    if body.stream:
                        await _stream(exchange, run)
                    else:
                        await _whole(exchange, run)
                finally:
                    for call in calls:
                        call.cancel()  # a no-op once the call ended; else decode stops now

        return Guarded(work, route=route, send_timeout_s=self.shared.send_timeout_s)


def metadata_of(who: Principal, user: str | None) -> tuple[tuple[str, str], ...]:
    """The client, and the end user when the body names one (percent-encoded where it
    is not printable ASCII, which metadata must be; the same user always the same)."""
    metadata = ((caller.METADATA_KEY, who.tenant),)
    if user:
        metadata += ((caller.USER_METADATA_KEY, quote(user, safe=_PRINTABLE)),)
    return metadata


async def collected(call: Any, params: dict[str, str]) -> Output:
    """One choice's stream, whole; its failure as the API error it becomes."""
    text: list[str] = []
    logprobs: list[generation_pb2.TokenLogprob] = []
    complete = None
    try:
        async for message in call:
            if message.HasField("chunk"):
                text.append(message.chunk.text)
                logprobs.extend(message.chunk.logprobs)
            else:
                complete = message.complete
    except grpc.aio.AioRpcError as error:
        raise from_rpc(error, params) from None
    if complete is None:
        raise _unfinished()
    return Output("".join(text), complete, logprobs)


async def _whole(exchange: Exchange, run: _Run) -> None:
    outputs = await asyncio.gather(*(collected(call, run.params) for call in run.calls))
    run.shape.fingerprint = outputs[0].complete.model_version or None
    await exchange.whole(JSONResponse(run.shape.whole(outputs)))


async def _next(messages: AsyncIterator[Any]) -> Any | None:
    return await anext(messages, None)


async def _stream(exchange: Exchange, run: _Run) -> None:
    """Every choice's first message is awaited before the response starts (a refusal is
    its real status); then their events interleave as they come, each with its index."""
    streams = [aiter(call) for call in run.calls]
    try:
        firsts = await asyncio.gather(*(_next(messages) for messages in streams))
    except grpc.aio.AioRpcError as error:
        raise from_rpc(error, run.params) from None
    await exchange.open_stream()
    shape = run.shape
    for index in range(len(streams)):
        if (opening := shape.opening(index)) is not None:
            await exchange.write(frame(opening))
    # Bounded: a client that reads slowly slows its generations, as one stream's would.
    events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=4 * len(streams))

    async def pump(index: int, first: Any, messages: AsyncIterator[Any]) -> None:
        """One choice's messages into the queue, then how its stream ended: None, or the
        error (any: a pump that ended unheard would leave the response waiting)."""
        end: Exception | None = None
        try:
            message = first
            while message is not None:
                await events.put((index, message))
                message = await _next(messages)
        except asyncio.CancelledError:
            raise  # the response is over; nobody reads the queue
        except Exception as error:
            end = error
        await events.put((index, end))

    pumps = [
        asyncio.create_task(pump(i, first, messages))
        for i, (first, messages) in enumerate(zip(firsts, streams, strict=True))
    ]
    completes: dict[int, Any] = {}
    try:
        open_choices = len(streams)
        while open_choices:
            index, message = await events.get()
            if message is None:
                open_choices -= 1
                if index not in completes:
                    await exchange.write(frame(_unfinished().body()))
                    break
            elif isinstance(message, grpc.aio.AioRpcError):
                await exchange.write(frame(from_rpc(message, run.params).body()))
                break
            elif isinstance(message, Exception):
                log.error("a generation stream failed", exc_info=message)
                await exchange.write(frame(_unfinished().body()))
                break
            elif message.HasField("chunk"):
                for event in shape.chunk_events(message.chunk, index):
                    await exchange.write(frame(event))
            else:
                completes[index] = message.complete
                shape.fingerprint = message.complete.model_version or None
                reason = finish_reason(message.complete.finish_reason)
                await exchange.write(frame(shape.finish_event(reason, index)))
        else:
            if shape.include_usage:
                ordered = [completes[i] for i in range(len(streams))]
                await exchange.write(frame(shape.usage_event(summed_usage(ordered))))
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    await exchange.write(DONE)
    await exchange.close()
