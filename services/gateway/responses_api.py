"""POST /v1/responses, OpenAI's Responses API, stateless: text, function tools and
structured output, on the generation service's Chat.

The request's items become a chat (messages, `function_call` items as an assistant's
calls, `function_call_output` items as tool turns), `instructions` its system turn,
`text.format` its constraint and the function tools its tools; the answer's text and
calls become `message` and `function_call` output items. Streamed, the events are the
API's own (response.created, output_item.added, output_text.delta,
function_call_arguments.delta, ..., response.completed). Nothing is stored: `store` is
accepted (the SDK sends it) but a `previous_response_id` is refused with a 400.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, sampling_pb2
from mesh import request_id
from services.gateway.completions import (
    DEFAULT_TEMPERATURE,
    PARAMS,
    ROLES,
    Completions,
    choose_tools,
    collected,
    metadata_of,
    output_constraint,
    tool_definition,
)
from services.gateway.errors import from_rpc, invalid, unsupported
from services.gateway.keys import Principal
from services.gateway.openai_types import ResponsesRequest
from services.gateway.responses import Exchange, Guarded
from services.gateway.sse import frame, summed_usage

ROUTE = "/v1/responses"
# The router's field paths in the Responses API's words.
RESPONSE_PARAMS = {
    **PARAMS,
    "messages": "input",
    "stopping.max_new_tokens": "max_output_tokens",
    "sampling.constraint": "text.format",
    "sampling.constraint.json_schema": "text.format.schema",
    "tool_choice.function": "tool_choice.name",
}


def _text_of(content: Any, where: str) -> str:
    """A message item's content: a string, or parts of input or output text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of text parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise invalid(f"{where}[{i}]", "only text parts (input_text, output_text)")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: ResponsesRequest) -> list[common_pb2.ChatMessage]:
    """The input items as a chat; consecutive function_call items are one assistant turn."""
    messages = []
    if body.instructions:
        messages.append(common_pb2.ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        return [*messages, common_pb2.ChatMessage(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role", "must be user, system, developer or assistant")
            content = _text_of(item.get("content"), f"{where}.content")
            messages.append(common_pb2.ChatMessage(role=ROLES.get(role, role), content=content))
        elif kind == "function_call":
            call = common_pb2.ToolCall(
                id=str(item.get("call_id", "")),
                name=str(item.get("name", "")),
                arguments=str(item.get("arguments", "")),
            )
            if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
                messages[-1].tool_calls.append(call)
            else:
                messages.append(common_pb2.ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                common_pb2.ChatMessage(
                    role="tool",
                    tool_call_id=str(item.get("call_id", "")),
                    content=output if isinstance(output, str) else json.dumps(output),
                )
            )
        else:
            raise unsupported(f"{where}.type", f"{kind!r} items are not supported")
    return messages


def chat_request(body: ResponsesRequest) -> generation_pb2.ChatRequest:
    sampling = sampling_pb2.SamplingParameters(
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
    )
    if body.top_p is not None:
        sampling.top_p = body.top_p
    form = body.text.format if body.text is not None else None
    kind, schema = (form.type, form.schema_) if form is not None else (None, None)
    if (output := output_constraint(kind, schema)) is not None:
        sampling.constraint.CopyFrom(output)
    request = generation_pb2.ChatRequest(
        request_id=request_id.current(),
        messages=_messages(body),
        sampling=sampling,
        model=body.model,
        tools=[tool_definition(t.name, t.description, t.parameters) for t in body.tools or []],
    )
    if body.max_output_tokens is not None:
        request.stopping.max_new_tokens = body.max_output_tokens
    choose_tools(request, body.tool_choice, body.parallel_tool_calls)
    return request


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status else []
    return {
        "type": "message",
        "id": f"msg_{secrets.token_hex(12)}",
        "status": status or "in_progress",
        "role": "assistant",
        "content": content,
    }


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{secrets.token_hex(12)}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass(frozen=True)
class Named:
    """What one response is called, whole or streamed."""

    id: str = field(default_factory=lambda: f"resp_{secrets.token_hex(16)}")
    created_at: int = field(default_factory=lambda: int(time.time()))


def response_body(
    body: ResponsesRequest, named: Named, output: list[dict[str, Any]], complete: Any | None
) -> dict[str, Any]:
    """The Response object around its output items; in progress while `complete` is
    None (a stream's first events)."""
    cut = complete is not None and complete.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    status = "in_progress" if complete is None else "incomplete" if cut else "completed"
    usage = None
    if complete is not None:
        counts = summed_usage([complete])
        usage = {
            "input_tokens": counts.prompt_tokens,
            "input_tokens_details": {"cached_tokens": counts.cached_tokens},
            "output_tokens": counts.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.total_tokens,
        }
    choice = body.tool_choice
    return {
        "id": named.id,
        "object": "response",
        "created_at": named.created_at,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": body.model,
        "instructions": body.instructions,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "text": body.text.model_dump(by_alias=True, exclude_none=True)
        if body.text is not None
        else {"format": {"type": "text"}},
        "store": False,
        "metadata": {},
        "usage": usage,
    }


def whole_output(text: str, complete: Any) -> list[dict[str, Any]]:
    """The answer as a message item (when there is text, or nothing else), each call a
    function_call item."""
    output = [_message_item(text)] if text or not complete.tool_calls else []
    return output + [
        _call_item(call.id, call.name, call.arguments, "completed") for call in complete.tool_calls
    ]


class _Events:
    """The stream's events as the Responses API frames them: `event: <type>` and the
    payload, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n".encode() + frame(payload)


@dataclass
class _Streamed:
    """What a stream has opened: the message item (once text came) and each call's item,
    by the router's call index, with their places in the output."""

    output: list[dict[str, Any]] = field(default_factory=list)
    message: dict[str, Any] | None = None
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)


async def _stream(exchange: Exchange, body: ResponsesRequest, named: Named, call: Any) -> None:
    messages = aiter(call)
    try:
        message = await anext(messages, None)
    except grpc.aio.AioRpcError as error:
        raise from_rpc(error, RESPONSE_PARAMS) from None
    await exchange.open_stream()
    event = _Events()
    opened = response_body(body, named, [], None)
    await exchange.write(event("response.created", response=opened))
    await exchange.write(event("response.in_progress", response=opened))
    streamed = _Streamed()
    complete = None
    try:
        while message is not None:
            if message.HasField("complete"):
                complete = message.complete
            else:
                for frame_ in _chunk_events(event, streamed, message.chunk):
                    await exchange.write(frame_)
            message = await anext(messages, None)
    except grpc.aio.AioRpcError as error:
        failure = from_rpc(error, RESPONSE_PARAMS).body()["error"]
        await exchange.write(event("error", **failure))
        await exchange.close()
        return
    if complete is None:
        await exchange.write(event("error", message="the generation ended without its result"))
        await exchange.close()
        return
    if streamed.message is None and not streamed.calls:
        for frame_ in _text_events(event, streamed, ""):
            await exchange.write(frame_)
    for frame_ in _closing_events(event, streamed):
        await exchange.write(frame_)
    await exchange.write(
        event("response.completed", response=response_body(body, named, streamed.output, complete))
    )
    await exchange.close()


def _text_events(event: _Events, streamed: _Streamed, text: str) -> list[bytes]:
    frames = []
    if streamed.message is None:
        streamed.message = _message_item("", status="")
        streamed.output.append(streamed.message)
        index = len(streamed.output) - 1
        frames.append(
            event("response.output_item.added", output_index=index, item=streamed.message)
        )
        part = {"type": "output_text", "text": "", "annotations": []}
        streamed.message["content"].append(part)
        frames.append(
            event(
                "response.content_part.added",
                item_id=streamed.message["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        )
    index = streamed.output.index(streamed.message)
    streamed.message["content"][0]["text"] += text
    if text:
        frames.append(
            event(
                "response.output_text.delta",
                item_id=streamed.message["id"],
                output_index=index,
                content_index=0,
                delta=text,
            )
        )
    return frames


def _chunk_events(event: _Events, streamed: _Streamed, chunk: Any) -> list[bytes]:
    frames = _text_events(event, streamed, chunk.text) if chunk.text else []
    for delta in chunk.tool_calls:
        if delta.id:
            item = _call_item(delta.id, delta.name, "", "in_progress")
            streamed.calls[delta.index] = item
            streamed.output.append(item)
            frames.append(
                event(
                    "response.output_item.added", output_index=len(streamed.output) - 1, item=item
                )
            )
        item = streamed.calls[delta.index]
        item["arguments"] += delta.arguments
        if delta.arguments:
            frames.append(
                event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=streamed.output.index(item),
                    delta=delta.arguments,
                )
            )
    return frames


def _closing_events(event: _Events, streamed: _Streamed) -> list[bytes]:
    frames = []
    for index, item in enumerate(streamed.output):
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            frames.append(event("response.output_text.done", **common, text=part["text"]))
            frames.append(event("response.content_part.done", **common, part=part))
        else:
            frames.append(
                event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        frames.append(event("response.output_item.done", output_index=index, item=item))
    return frames


def respond(completions: Completions, body: ResponsesRequest, who: Principal) -> Guarded:
    body.refuse_unsupported()
    completions.shared.catalog.require("chat", body.model)
    request = chat_request(body)

    async def work(exchange: Exchange) -> None:
        async with completions.shared.admitted(who, ROUTE, model=None, streaming=body.stream):
            call = completions.stub.Chat(request, metadata=metadata_of(who, body.user))
            named = Named()
            try:
                if body.stream:
                    await _stream(exchange, body, named, call)
                    return
                (output,) = await collected(call, RESPONSE_PARAMS)
            finally:
                call.cancel()
            items = whole_output(output.text, output.complete)
            answer = response_body(body, named, items, output.complete)
            await exchange.whole(JSONResponse(answer))

    return Guarded(work, route=ROUTE, send_timeout_s=completions.shared.send_timeout_s)
