"""The tokenizer's gRPC surface: validate at the boundary, call the engine, map the results.

Tokenizing is CPU work. Measured on 2 cores: 1 KB of text encodes in ~0.2 ms, 1 MiB in
~0.45 s, and its details (token strings and offsets as 260k protobuf messages) take ~0.8 s
more. Work on more than THREAD_MIN_BYTES of UTF-8 therefore runs in a worker thread, so the
event loop keeps answering other calls meanwhile (the Rust encoder releases the GIL);
smaller work runs inline, where a thread hop (~70 µs) would cost about as much. Bytes, not
characters, measure it: 8,000 emoji are 32 KB and ~24k tokens.

Every limit is one the engine serves within: a text, or a conversation's contents in all,
of at most 1 MiB; ids, and a conversation's turns, at most the model's context, which is
also all that one DetokenizeStream may carry (it detokenizes one generation).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc

from aimesh.common.v1 import common_pb2
from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh import request_id
from mesh.server import MeshServer
from mesh.validation import Violations
from services.llm.artifacts import model_directory
from services.llm.described import described
from services.llm.settings import LlmSettings, llm_settings
from services.tokenizer.engine import IncrementalDetokenizer, Tokenized, TokenizerEngine

SERVICE = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"]

MAX_TEXT_BYTES = 1024 * 1024
THREAD_MIN_BYTES = 8 * 1024  # ~1.5 ms of tokenizing
# Rendering one turn of the chat template costs about as much as tokenizing this much text.
TURN_BYTES = 64
# The router's bound on a request's tool descriptions and schemas (tool_calls.py).
MAX_TOOLS_BYTES = 256 * 1024
WARMUP_TEXT = "Hello, world! Tokenized once before readiness: naïve café 日本語 🙂"

T = TypeVar("T")


async def _run(work: Callable[[], T], size: int) -> T:
    """Runs `work` in a worker thread when its input (`size`, in bytes) is large enough
    to stall the loop."""
    if size > THREAD_MIN_BYTES:
        return await asyncio.to_thread(work)
    return work()


def _tools(text: str, violations: Violations) -> list[dict[str, Any]] | None:
    """ApplyChatTemplateRequest.tools, parsed: a JSON array of objects, or None."""
    if not text:
        return None
    if not violations.max_length(text.encode(), "tools", MAX_TOOLS_BYTES):
        return None
    try:
        tools = json.loads(text)
    except (ValueError, RecursionError):
        tools = None
    violations.check(
        isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools),
        "tools",
        "must be a JSON array of objects (OpenAI's tools)",
    )
    return tools


def openai_messages(messages: Sequence[common_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """The turns in OpenAI's shape, as templates that know tools read them: a call's
    arguments as an object where they parse as one (templates write them with `tojson`),
    a tool turn with the name of the function it answers."""
    names = {call.id: call.name for message in messages for call in message.tool_calls}
    shaped: list[dict[str, Any]] = []
    for message in messages:
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            turn["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _arguments(call.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id:
            turn["tool_call_id"] = message.tool_call_id
            turn["name"] = names.get(message.tool_call_id, "")
        shaped.append(turn)
    return shaped


def _arguments(text: str) -> Any:
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return parsed if isinstance(parsed, dict) else text


def _size_problem(size: int) -> str:
    return f"must be at most {MAX_TEXT_BYTES} bytes of UTF-8, got {size}"


def _check_request_id(violations: Violations, value: str) -> None:
    violations.check(request_id.is_valid(value), "request_id", request_id.RULE)


def _check_vocabulary(violations: Violations, ids: Sequence[int], vocab_size: int) -> None:
    for index, id_ in enumerate(ids):
        if id_ >= vocab_size:
            violations.add(
                f"token_ids[{index}]", f"must be < the vocabulary size {vocab_size}, got {id_}"
            )


def _check_messages(
    violations: Violations,
    messages: Sequence[common_pb2.ChatMessage],
    roles: frozenset[str],
    max_turns: int,
) -> None:
    """Turns are bounded by the context, since each one renders to tokens of its own, and
    contents by what one Tokenize may bring, since the rendered prompt is tokenized."""
    count = len(messages)
    if not violations.check(count > 0, "messages", "must hold at least one message"):
        return
    if not violations.check(
        count <= max_turns,
        "messages",
        f"must hold at most {max_turns} messages (every turn takes tokens of the "
        f"{max_turns}-token context), got {count}",
    ):
        return  # not worth scanning: the request fails anyway
    sizes = [len(message.content.encode()) for message in messages]
    known = ", ".join(sorted(roles))
    for index, (message, size) in enumerate(zip(messages, sizes, strict=True)):
        if message.role not in roles:
            # Quoted only in part: a role of a megabyte must not become the status.
            got = repr(message.role[:40])
            violations.add(f"messages[{index}].role", f"must be one of {known}, got {got}")
        if size > MAX_TEXT_BYTES:
            violations.add(f"messages[{index}].content", _size_problem(size))
    if max(sizes) <= MAX_TEXT_BYTES:
        violations.check(
            sum(sizes) <= MAX_TEXT_BYTES,
            "messages",
            f"contents must be at most {MAX_TEXT_BYTES} bytes of UTF-8 in all, got {sum(sizes)}",
        )


def tokenize_response(tokenized: Tokenized) -> tokenizer_pb2.TokenizeResponse:
    """The response, its offsets added in place: a list of TokenOffset messages first would
    hold ~420 bytes a token at once (~330 MB for a 1 MiB text of emoji)."""
    response = tokenizer_pb2.TokenizeResponse(token_ids=tokenized.ids, tokens=tokenized.tokens)
    add = response.offsets.add
    for start, end in tokenized.offsets:
        add(start=start, end=end)
    return response


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Serves the engine the warm-up hands it (MeshServer refuses calls before that)."""

    def __init__(self, max_seq_len: int) -> None:
        self.max_seq_len = max_seq_len
        # Set by the warm-up; MeshServer answers every call NOT_READY until it has run.
        self.engine: TokenizerEngine

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        engine = self.engine
        violations = Violations()
        _check_request_id(violations, request.request_id)
        size = len(request.text.encode())
        violations.check(size <= MAX_TEXT_BYTES, "text", _size_problem(size))
        violations.raise_if_any()
        # Tokenized and answered in one go, so that both run in the worker thread for a
        # long text: its offsets take longer to build than the tokens.
        return await _run(
            lambda: tokenize_response(
                engine.tokenize(request.text, request.add_special_tokens, request.return_details)
            ),
            size,
        )

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        engine = self.engine
        ids = request.token_ids
        violations = Violations()
        _check_request_id(violations, request.request_id)
        if violations.check(
            len(ids) <= self.max_seq_len,
            "token_ids",
            f"must hold at most {self.max_seq_len} ids, got {len(ids)}",
        ):
            _check_vocabulary(violations, ids, engine.vocab_size)
        violations.raise_if_any()
        text = engine.detokenize(ids, request.skip_special_tokens)
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def DetokenizeStream(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeStreamResponse]:
        """Inline: the ids held back are at most the context, so a message costs at most
        two decodes of that many ids (~3 ms)."""
        engine = self.engine
        detokenizer: IncrementalDetokenizer | None = None
        received = 0
        async for request in request_iterator:
            violations = Violations()
            if detokenizer is None:  # request_id counts in the first message only
                _check_request_id(violations, request.request_id)
            received += len(request.token_ids)
            if violations.check(
                received <= self.max_seq_len,
                "token_ids",
                f"the stream must carry at most {self.max_seq_len} ids in all (the model's "
                f"context), got {received}",
            ):
                _check_vocabulary(violations, request.token_ids, engine.vocab_size)
            violations.raise_if_any()
            if detokenizer is None:  # skip_special_tokens counts in the first message only
                detokenizer = engine.incremental_detokenizer(request.skip_special_tokens)
            yield tokenizer_pb2.DetokenizeStreamResponse(text=detokenizer.push(request.token_ids))
        held_back = detokenizer.finish() if detokenizer is not None else ""
        if held_back:
            yield tokenizer_pb2.DetokenizeStreamResponse(text=held_back)

    async def ApplyChatTemplate(
        self, request: tokenizer_pb2.ApplyChatTemplateRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        engine = self.engine
        violations = Violations()
        _check_request_id(violations, request.request_id)
        _check_messages(violations, request.messages, engine.roles, self.max_seq_len)
        tools = _tools(request.tools, violations)
        violations.raise_if_any()
        messages = openai_messages(request.messages)
        size = sum(len(m.content.encode()) + TURN_BYTES for m in request.messages)
        prompt = await _run(
            lambda: engine.apply_chat_template(
                messages, request.add_generation_prompt, request.return_token_ids, tools
            ),
            size + len(request.tools),
        )
        return tokenizer_pb2.ApplyChatTemplateResponse(
            text=prompt.text,
            token_ids=prompt.ids,
            tool_format=engine.tool_format,
            roles=sorted(engine.roles),
        )


def _load_engine(server: MeshServer, settings: LlmSettings) -> TokenizerEngine:
    directory = model_directory(settings, server.settings.cache_dir)
    engine = TokenizerEngine.load(directory, settings.chat_template)
    engine.tokenize(WARMUP_TEXT, add_special_tokens=True, return_details=True)
    server.describe(described(directory, settings, engine="tokenizers"))
    return engine


async def setup(server: MeshServer) -> None:
    """Registers the servicer now and loads the model's tokenizer in the warm-up, in a
    thread: converting the embedded model takes ~20 s the first time, and liveness must
    answer meanwhile."""
    llm = llm_settings(server.settings)
    servicer = TokenizerServicer(max_seq_len=llm.max_seq_len)
    server.add_service(tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server, servicer, SERVICE)

    async def load() -> None:
        servicer.engine = await asyncio.to_thread(_load_engine, server, llm)

    server.add_warmup(load)
