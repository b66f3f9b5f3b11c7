"""Server-sent events as OpenAI frames them, and the bodies of chat and text completions,
streamed and whole.

A stream is `data: <json>\n\n` events that all carry the same `id`, exactly one of them
with a finish_reason, then (with stream_options.include_usage) one event whose `choices`
is empty and which carries the usage, then `data: [DONE]\n\n`. With include_usage every
other event has `"usage": null`, as OpenAI sends it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, sampling_pb2

DONE = b"data: [DONE]\n\n"


def frame(payload: dict[str, Any]) -> bytes:
    """One event; JSON keeps non-ASCII text as it is (SSE is UTF-8)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def finish_reason(reason: int) -> str:
    """The mesh's finish reason in OpenAI's words: a length limit, tool calls, or a
    natural or asked-for stop (end of sequence, a stop sequence, an operator's abort)."""
    if reason == sampling_pb2.FINISH_REASON_LENGTH:
        return "length"
    return "tool_calls" if reason == sampling_pb2.FINISH_REASON_TOOL_CALLS else "stop"


def tool_call(call: common_pb2.ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def usage(message: common_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": message.prompt_tokens,
        "completion_tokens": message.completion_tokens,
        "total_tokens": message.total_tokens,
        "prompt_tokens_details": {"cached_tokens": message.cached_tokens},
    }


@dataclass
class _Shape:
    """What every event and body of one completion shares."""

    chunk_object: ClassVar[str] = ""
    model: str
    created: int
    include_usage: bool = False
    id: str = field(default="")
    # The registered model version that served it (OpenAI: "the backend configuration
    # that the model runs with"), known once the generation completes; None before, and
    # for a model the registry does not version.
    fingerprint: str | None = None

    def _envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_event(self, counts: common_pb2.Usage) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage(counts)}


@dataclass
class ChatShape(_Shape):
    """chat.completion and chat.completion.chunk."""

    chunk_object: ClassVar[str] = "chat.completion.chunk"

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-{uuid.uuid4().hex}"

    def _event(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return self._envelope(self.chunk_object, [choice])

    def opening(self) -> dict[str, Any] | None:
        """The first event: the role, before any text."""
        return self._event({"role": "assistant", "content": ""}, None)

    def text_event(self, text: str) -> dict[str, Any]:
        return self._event({"content": text}, None)

    def tool_calls_event(self, deltas: list[generation_pb2.ToolCallDelta]) -> dict[str, Any]:
        """OpenAI's streamed calls: a call's first delta carries its id, type and name
        (and no arguments yet), later ones more of its arguments."""
        calls = []
        for delta in deltas:
            call: dict[str, Any] = {"index": delta.index}
            if delta.id:
                call.update(id=delta.id, type="function")
                call["function"] = {"name": delta.name, "arguments": delta.arguments}
            else:
                call["function"] = {"arguments": delta.arguments}
            calls.append(call)
        return self._event({"tool_calls": calls}, None)

    def finish_event(self, reason: str) -> dict[str, Any]:
        return self._event({}, reason)

    def whole(
        self,
        text: str,
        reason: str,
        counts: common_pb2.Usage,
        calls: list[common_pb2.ToolCall] | None = None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if calls:
            message.update(content=text or None, tool_calls=[tool_call(c) for c in calls])
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        body = self._envelope("chat.completion", [choice])
        return {**body, "usage": usage(counts)}


@dataclass
class TextShape(_Shape):
    """text_completion, streamed and whole (OpenAI names both the same)."""

    chunk_object: ClassVar[str] = "text_completion"

    def __post_init__(self) -> None:
        self.id = self.id or f"cmpl-{uuid.uuid4().hex}"

    def _event(self, text: str, reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._envelope(self.chunk_object, [choice])

    def opening(self) -> dict[str, Any] | None:
        """Completions have no role: the first event is text."""
        return None

    def text_event(self, text: str) -> dict[str, Any]:
        return self._event(text, None)

    def finish_event(self, reason: str) -> dict[str, Any]:
        return self._event("", reason)

    def whole(
        self,
        text: str,
        reason: str,
        counts: common_pb2.Usage,
        calls: list[common_pb2.ToolCall] | None = None,
    ) -> dict[str, Any]:
        """`calls`: never any for a text completion (only chat offers tools)."""
        body = self._envelope("text_completion", [])
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**body, "choices": [choice], "usage": usage(counts)}
