"""The tokenizer's gRPC surface: validate at the boundary, call the engine, map the results.

Tokenizing is CPU work. Measured on 2 cores: 1 KB of text encodes in ~0.2 ms, 1 MiB in
~0.45 s, and its details (token strings and offsets as 260k protobuf messages) take ~0.8 s
more. Texts longer than THREAD_MIN_CHARS therefore run in a worker thread, so the event
loop keeps answering other calls meanwhile (the Rust encoder releases the GIL); shorter
ones run inline, where a thread hop (~70 µs) would cost about as much as the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import TypeVar

import grpc

from aimesh.common.v1 import common_pb2
from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh.failures import NotReady
from mesh.server import MeshServer
from mesh.validation import Violations
from services.llm.artifacts import resolve_model
from services.llm.settings import llm_settings
from services.tokenizer.engine import IncrementalDetokenizer, TokenizerEngine

SERVICE = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"]

MAX_TEXT_BYTES = 1024 * 1024
THREAD_MIN_CHARS = 8 * 1024  # ~1.5 ms of tokenizing
# BadRequest travels in trailing metadata, which gRPC caps at 8 KiB by default: a repeated
# field reports its first bad elements, not thousands.
MAX_ELEMENT_VIOLATIONS = 16
WARMUP_TEXT = "Hello, world! Tokenized once before readiness: naïve café 日本語 🙂"

T = TypeVar("T")


async def _run(work: Callable[[], T], chars: int) -> T:
    """Runs `work` in a worker thread when its input is long enough to stall the loop."""
    if chars > THREAD_MIN_CHARS:
        return await asyncio.to_thread(work)
    return work()


def _size_problem(text: str) -> str | None:
    size = len(text.encode())
    if size <= MAX_TEXT_BYTES:
        return None
    return f"must be at most {MAX_TEXT_BYTES} bytes of UTF-8, got {size}"


def _check_text(violations: Violations, text: str) -> None:
    problem = _size_problem(text)
    if problem is not None:
        violations.add("text", problem)


def _check_token_ids(
    violations: Violations, ids: Sequence[int], vocab_size: int, max_ids: int
) -> None:
    if not violations.check(
        len(ids) <= max_ids, "token_ids", f"must hold at most {max_ids} ids, got {len(ids)}"
    ):
        return  # not worth scanning: the request fails anyway
    out_of_vocab = ((index, id_) for index, id_ in enumerate(ids) if id_ >= vocab_size)
    for index, id_ in islice(out_of_vocab, MAX_ELEMENT_VIOLATIONS):
        violations.add(
            f"token_ids[{index}]", f"must be < the vocabulary size {vocab_size}, got {id_}"
        )


def _check_messages(
    violations: Violations,
    messages: Sequence[common_pb2.ChatMessage],
    roles: frozenset[str],
) -> None:
    if not violations.check(bool(messages), "messages", "must hold at least one message"):
        return
    for field, problem in islice(_message_problems(messages, roles), MAX_ELEMENT_VIOLATIONS):
        violations.add(field, problem)


def _message_problems(
    messages: Sequence[common_pb2.ChatMessage], roles: frozenset[str]
) -> Iterator[tuple[str, str]]:
    known = ", ".join(sorted(roles))
    for index, message in enumerate(messages):
        if message.role not in roles:
            # Quoted only in part: a role of a megabyte must not become the status.
            got = repr(message.role[:40])
            yield f"messages[{index}].role", f"must be one of {known}, got {got}"
        problem = _size_problem(message.content)
        if problem is not None:
            yield f"messages[{index}].content", problem


def _tokenize(
    engine: TokenizerEngine, request: tokenizer_pb2.TokenizeRequest
) -> tokenizer_pb2.TokenizeResponse:
    """Tokenizes and builds the response together, so that both run in the worker thread
    for a long text: its offsets messages take longer to build than the tokens."""
    tokenized = engine.tokenize(request.text, request.add_special_tokens, request.return_details)
    return tokenizer_pb2.TokenizeResponse(
        token_ids=tokenized.ids,
        tokens=tokenized.tokens,
        offsets=[tokenizer_pb2.TokenOffset(start=s, end=e) for s, e in tokenized.offsets],
    )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Answers NotReady until the warm-up hands it a loaded engine."""

    def __init__(self, max_seq_len: int) -> None:
        self.max_seq_len = max_seq_len
        self.engine: TokenizerEngine | None = None

    def _loaded(self) -> TokenizerEngine:
        if self.engine is None:
            raise NotReady("the tokenizer is still loading")
        return self.engine

    def _check_ids(self, engine: TokenizerEngine, ids: Sequence[int]) -> None:
        violations = Violations()
        _check_token_ids(violations, ids, engine.vocab_size, self.max_seq_len)
        violations.raise_if_any()

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        engine = self._loaded()
        violations = Violations()
        _check_text(violations, request.text)
        violations.raise_if_any()
        return await _run(lambda: _tokenize(engine, request), len(request.text))

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        engine = self._loaded()
        self._check_ids(engine, request.token_ids)
        text = engine.detokenize(request.token_ids, request.skip_special_tokens)
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def DetokenizeStream(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeStreamResponse]:
        engine = self._loaded()
        detokenizer: IncrementalDetokenizer | None = None
        async for request in request_iterator:
            self._check_ids(engine, request.token_ids)
            if detokenizer is None:  # skip_special_tokens counts in the first message only
                detokenizer = engine.incremental_detokenizer(request.skip_special_tokens)
            yield tokenizer_pb2.DetokenizeStreamResponse(text=detokenizer.push(request.token_ids))
        held_back = detokenizer.finish() if detokenizer is not None else ""
        if held_back:
            yield tokenizer_pb2.DetokenizeStreamResponse(text=held_back)

    async def ApplyChatTemplate(
        self, request: tokenizer_pb2.ApplyChatTemplateRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        engine = self._loaded()
        violations = Violations()
        _check_messages(violations, request.messages, engine.roles)
        violations.raise_if_any()
        messages = [(message.role, message.content) for message in request.messages]
        prompt = await _run(
            lambda: engine.apply_chat_template(
                messages, request.add_generation_prompt, request.return_token_ids
            ),
            sum(len(content) for _, content in messages),
        )
        return tokenizer_pb2.ApplyChatTemplateResponse(text=prompt.text, token_ids=prompt.ids)


def _load_engine(model: Path | None, cache_dir: Path) -> TokenizerEngine:
    engine = TokenizerEngine.load(resolve_model(model, cache_dir))
    engine.tokenize(WARMUP_TEXT, add_special_tokens=True, return_details=True)
    return engine


async def setup(server: MeshServer) -> None:
    """Registers the servicer now and loads the model's tokenizer in the warm-up, in a
    thread: converting the embedded model takes ~20 s the first time, and liveness must
    answer meanwhile."""
    llm = llm_settings(server.settings)
    servicer = TokenizerServicer(max_seq_len=llm.max_seq_len)
    server.add_service(tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server, servicer, SERVICE)

    async def load() -> None:
        servicer.engine = await asyncio.to_thread(
            _load_engine, llm.model, server.settings.cache_dir
        )

    server.add_warmup(load)
