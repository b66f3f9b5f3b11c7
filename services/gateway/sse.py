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
from collections.abc import Sequence
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


@dataclass(frozen=True)
class Output:
    """One choice, whole: its text, the generation's last message and, when asked for,
    its tokens' logprobs."""

    text: str
    complete: generation_pb2.GenerationComplete
    logprobs: Sequence[generation_pb2.TokenLogprob] = ()


def _alternative(entry: generation_pb2.TokenLogprob | generation_pb2.TopLogprob) -> dict:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.bytes)}


def chat_logprobs(entries: Sequence[generation_pb2.TokenLogprob]) -> dict[str, Any]:
    """Chat's logprobs object: each token with its bytes and its likely alternatives."""
    content = [
        {**_alternative(e), "top_logprobs": [_alternative(t) for t in e.top_logprobs]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def text_logprobs(entries: Sequence[generation_pb2.TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions' logprobs object, columns by token; `offset` is where the
    first token starts in the completion's text (text_offset counts characters)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }


def summed_usage(completes: list[generation_pb2.GenerationComplete]) -> common_pb2.Usage:
    """n choices' usage as OpenAI counts it: the prompt once, every choice's tokens."""
    first = completes[0].usage
    generated = sum(c.usage.completion_tokens for c in completes)
    return common_pb2.Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=generated,
        total_tokens=first.prompt_tokens + generated,
        cached_tokens=first.cached_tokens,
    )


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
    # The request asked for logprobs: every choice carries them.
    logprobs: bool = False

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

    def _event(
        self,
        delta: dict[str, Any],
        reason: str | None,
        index: int,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._envelope(self.chunk_object, [choice])

    def opening(self, index: int = 0) -> dict[str, Any] | None:
        """A choice's first event: the role, before any text."""
        return self._event({"role": "assistant", "content": ""}, None, index)

    def chunk_events(
        self, chunk: generation_pb2.GenerationChunk, index: int = 0
    ) -> list[dict[str, Any]]:
        """A chunk's text (with its tokens' logprobs), then its tool calls: OpenAI's
        streamed calls carry a call's id, type and name first (and no arguments yet), later
        more of its arguments."""
        logprobs = chat_logprobs(chunk.logprobs) if self.logprobs and chunk.logprobs else None
        events = []
        if chunk.text or logprobs is not None:
            events.append(self._event({"content": chunk.text}, None, index, logprobs))
        calls = []
        for delta in chunk.tool_calls:
            call: dict[str, Any] = {"index": delta.index}
            if delta.id:
                call.update(id=delta.id, type="function")
                call["function"] = {"name": delta.name, "arguments": delta.arguments}
            else:
                call["function"] = {"arguments": delta.arguments}
            calls.append(call)
        if calls:
            events.append(self._event({"tool_calls": calls}, None, index))
        return events

    def finish_event(self, reason: str, index: int = 0) -> dict[str, Any]:
        return self._event({}, reason, index)

    def whole(self, outputs: list[Output]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(outputs):
            message: dict[str, Any] = {"role": "assistant", "content": output.text, "refusal": None}
            if output.complete.tool_calls:
                calls = [tool_call(c) for c in output.complete.tool_calls]
                message.update(content=output.text or None, tool_calls=calls)
            reason = finish_reason(output.complete.finish_reason)
            logprobs = chat_logprobs(output.logprobs) if self.logprobs else None
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
            )
        body = self._envelope("chat.completion", choices)
        return {**body, "usage": usage(summed_usage([o.complete for o in outputs]))}


@dataclass
class TextShape(_Shape):
    """text_completion, streamed and whole (OpenAI names both the same)."""

    chunk_object: ClassVar[str] = "text_completion"

    # Characters each streamed choice has sent, where its next token's text_offset is.
    _sent: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = self.id or f"cmpl-{uuid.uuid4().hex}"

    def _event(
        self, text: str, reason: str | None, index: int, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return self._envelope(self.chunk_object, [choice])

    def opening(self, index: int = 0) -> dict[str, Any] | None:
        """Completions have no role: the first event is text."""
        return None

    def chunk_events(
        self, chunk: generation_pb2.GenerationChunk, index: int = 0
    ) -> list[dict[str, Any]]:
        if not (self.logprobs and chunk.logprobs):
            return [self._event(chunk.text, None, index)] if chunk.text else []
        sent = self._sent.get(index, 0)
        self._sent[index] = sent + sum(len(e.token) for e in chunk.logprobs)
        return [self._event(chunk.text, None, index, text_logprobs(chunk.logprobs, sent))]

    def finish_event(self, reason: str, index: int = 0) -> dict[str, Any]:
        return self._event("", reason, index)

    def whole(self, outputs: list[Output]) -> dict[str, Any]:
        choices = [
            {
                "index": index,
                "text": output.text,
                "logprobs": text_logprobs(output.logprobs, 0) if self.logprobs else None,
                "finish_reason": finish_reason(output.complete.finish_reason),
            }
            for index, output in enumerate(outputs)
        ]
        body = self._envelope("text_completion", choices)
        return {**body, "usage": usage(summed_usage([o.complete for o in outputs]))}
