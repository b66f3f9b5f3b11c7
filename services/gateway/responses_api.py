"""POST /v1/responses, OpenAI's Responses API, stateless: text, function tools and
structured output, on the generation service's Chat.

The request's items become a chat (messages, `function_call` items as an assistant's
calls, `function_call_output` items as tool turns), `instructions` its system turn,
`text.format` its constraint and the function tools its tools; the answer's text and
calls become `message` and `function_call` output items. Nothing is stored: `store` is
accepted (the SDK sends it) but a `previous_response_id` is refused with a 400, as is
`stream` for now (the Agents SDK's `Runner.run` does not stream; `run_streamed` needs it).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from fastapi.responses import JSONResponse

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, sampling_pb2
from mesh import request_id
from services.gateway.completions import (
    DEFAULT_TEMPERATURE,
    PARAMS,
    ROLES,
    TOOL_CHOICE_MODES,
    Completions,
    collected,
    metadata_of,
)
from services.gateway.errors import invalid, unsupported
from services.gateway.keys import Principal
from services.gateway.openai_types import ResponsesRequest
from services.gateway.responses import Exchange, Guarded
from services.gateway.sse import summed_usage

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
    if form is not None and form.type == "json_object":
        sampling.constraint.json_object = True
    elif form is not None and form.type == "json_schema":
        if form.schema_ is None:
            sampling.constraint.json_object = True
        else:
            sampling.constraint.json_schema = json.dumps(form.schema_)
    request = generation_pb2.ChatRequest(
        request_id=request_id.current(),
        messages=_messages(body),
        sampling=sampling,
        model=body.model,
        tools=[
            generation_pb2.ToolDefinition(
                name=tool.name,
                description=tool.description or "",
                parameters=json.dumps(tool.parameters) if tool.parameters else "",
            )
            for tool in body.tools or []
        ],
    )
    if body.max_output_tokens is not None:
        request.stopping.max_new_tokens = body.max_output_tokens
    if isinstance(body.tool_choice, str):
        request.tool_choice.mode = TOOL_CHOICE_MODES[body.tool_choice]
    elif body.tool_choice is not None:
        request.tool_choice.function = body.tool_choice.name
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls
    return request


def response_body(body: ResponsesRequest, text: str, complete: Any) -> dict[str, Any]:
    """The Response object: the answer as a message item, each call a function_call."""
    output: list[dict[str, Any]] = []
    if text or not complete.tool_calls:
        output.append(
            {
                "type": "message",
                "id": f"msg_{secrets.token_hex(12)}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    output += [
        {
            "type": "function_call",
            "id": f"fc_{secrets.token_hex(12)}",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        for call in complete.tool_calls
    ]
    cut = complete.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    usage = summed_usage([complete])
    return {
        "id": f"resp_{secrets.token_hex(16)}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": body.model,
        "instructions": body.instructions,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "text": {"format": {"type": "text"}},
        "store": False,
        "metadata": {},
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        },
    }


def respond(completions: Completions, body: ResponsesRequest, who: Principal) -> Guarded:
    body.refuse_unsupported()
    completions.shared.catalog.require("chat", body.model)
    request = chat_request(body)

    async def work(exchange: Exchange) -> None:
        async with completions.shared.admitted(who, ROUTE, model=None, streaming=False):
            call = completions.stub.Chat(request, metadata=metadata_of(who, body.user))
            try:
                output = await collected(call, RESPONSE_PARAMS)
            finally:
                call.cancel()
            answer = response_body(body, output.text, output.complete)
            await exchange.whole(JSONResponse(answer))

    return Guarded(work, route=ROUTE, send_timeout_s=completions.shared.send_timeout_s)
