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

import json
import string
import time
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
    "sampling.n": "n",
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
    if body.n is not None and body.n > 1:
        message.n = body.n
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
    """One completion: its call (every choice, sampling.n, in one stream), and how to
    answer it."""

    call: Any
    choices: int
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
                call = method(request, metadata=metadata)
                run = _Run(call, body.n or 1, body, shape, params_of(body))
                try:
                    if body.stream:
                        await _stream(exchange, run)
                    else:
                        await _whole(exchange, run)
                finally:
                    call.cancel()  # a no-op once the call ended; else decode stops now

        return Guarded(work, route=route, send_timeout_s=self.shared.send_timeout_s)


def metadata_of(who: Principal, user: str | None) -> tuple[tuple[str, str], ...]:
    """The client, and the end user when the body names one (percent-encoded where it
    is not printable ASCII, which metadata must be; the same user always the same)."""
    metadata = ((caller.METADATA_KEY, who.tenant),)
    if user:
        metadata += ((caller.USER_METADATA_KEY, quote(user, safe=_PRINTABLE)),)
    return metadata


async def collected(call: Any, params: dict[str, str], choices: int = 1) -> list[Output]:
    """Every choice of the stream, whole, in order; a failure as the API error it
    becomes."""
    text: list[list[str]] = [[] for _ in range(choices)]
    logprobs: list[list[generation_pb2.TokenLogprob]] = [[] for _ in range(choices)]
    completes: dict[int, generation_pb2.GenerationComplete] = {}
    try:
        async for message in call:
            if message.HasField("chunk"):
                text[message.chunk.index].append(message.chunk.text)
                logprobs[message.chunk.index].extend(message.chunk.logprobs)
            else:
                completes[message.complete.index] = message.complete
    except grpc.aio.AioRpcError as error:
        raise from_rpc(error, params) from None
    if len(completes) < choices:
        raise _unfinished()
    return [Output("".join(text[i]), completes[i], logprobs[i]) for i in range(choices)]


async def _whole(exchange: Exchange, run: _Run) -> None:
    outputs = await collected(run.call, run.params, run.choices)
    run.shape.fingerprint = outputs[0].complete.model_version or None
    await exchange.whole(JSONResponse(run.shape.whole(outputs)))


async def _stream(exchange: Exchange, run: _Run) -> None:
    """The first message is awaited before the response starts (a refusal is its real
    status); then every choice opens, and their events go out as they come, each with
    its choice's index."""
    messages = aiter(run.call)
    try:
        message = await anext(messages, None)
    except grpc.aio.AioRpcError as error:
        raise from_rpc(error, run.params) from None
    await exchange.open_stream()
    shape = run.shape
    for index in range(run.choices):
        if (opening := shape.opening(index)) is not None:
            await exchange.write(frame(opening))
    completes: dict[int, Any] = {}
    try:
        while message is not None:
            if message.HasField("chunk"):
                for event in shape.chunk_events(message.chunk, message.chunk.index):
                    await exchange.write(frame(event))
            else:
                index = message.complete.index
                completes[index] = message.complete
                shape.fingerprint = message.complete.model_version or None
                reason = finish_reason(message.complete.finish_reason)
                await exchange.write(frame(shape.finish_event(reason, index)))
            message = await anext(messages, None)
    except grpc.aio.AioRpcError as error:
        await exchange.write(frame(from_rpc(error, run.params).body()))
    else:
        if len(completes) < run.choices:
            await exchange.write(frame(_unfinished().body()))
        elif shape.include_usage:
            ordered = [completes[i] for i in range(run.choices)]
            await exchange.write(frame(shape.usage_event(summed_usage(ordered))))
    await exchange.write(DONE)
    await exchange.close()
