"""The tokenizer service as the router uses it: prompts to ids before a generation, and
ids back to text while one streams, whichever engine generates."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh.client import ChannelPool

TOKENIZER = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"]


class TokenizerClient:
    def __init__(self, channels: ChannelPool, target: str) -> None:
        self.channels = channels
        self.target = target

    def _stub(self) -> tokenizer_pb2_grpc.TokenizerServiceStub:
        return tokenizer_pb2_grpc.TokenizerServiceStub(self.channels.get(self.target, TOKENIZER))

    async def tokenize(self, prompt: str, request_id: str) -> list[int]:
        response = await self._stub().Tokenize(
            tokenizer_pb2.TokenizeRequest(
                request_id=request_id, text=prompt, add_special_tokens=True
            )
        )
        return list(response.token_ids)

    async def tokenize_choice(self, choice: str, request_id: str) -> list[int]:
        """A guided choice's tokens as they follow the prompt: no special tokens."""
        response = await self._stub().Tokenize(
            tokenizer_pb2.TokenizeRequest(
                request_id=request_id, text=choice, add_special_tokens=False
            )
        )
        return list(response.token_ids)

    async def apply_chat_template(self, request_id: str, messages: list) -> list[int]:
        response = await self._stub().ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(
                request_id=request_id,
                messages=messages,
                add_generation_prompt=True,
                return_token_ids=True,
            )
        )
        return list(response.token_ids)

    def detokenizer(self) -> Detokenizer:
        """A stream not yet opened: open it inside the block that cleans up after it."""
        return Detokenizer(self._stub().DetokenizeStream())


class Detokenizer:
    """One generation's DetokenizeStream: text comes back only once it is whole (a
    multi-byte character split across tokens waits for its last token)."""

    def __init__(self, call) -> None:
        self._call = call

    async def open(self, request_id: str) -> None:
        await self._write(
            tokenizer_pb2.DetokenizeStreamRequest(request_id=request_id, skip_special_tokens=True)
        )
        await self._call.read()

    async def push(self, token_ids: list[int]) -> str:
        await self._write(tokenizer_pb2.DetokenizeStreamRequest(token_ids=token_ids))
        return (await self._call.read()).text

    async def _write(self, request: tokenizer_pb2.DetokenizeStreamRequest) -> None:
        """A write to a stream that already ended (its deadline, a margin before the
        caller's, passed) says only "RPC already finished": reading gives its status."""
        try:
            await self._call.write(request)
        except asyncio.InvalidStateError:
            await self._call.read()
            raise

    async def finish(self) -> AsyncIterator[str]:
        """The text still held back once no more tokens come."""
        await self._call.done_writing()
        while (tail := await self._call.read()) is not grpc.aio.EOF:
            if tail.text:
                yield tail.text

    def cancel(self) -> None:
        self._call.cancel()
