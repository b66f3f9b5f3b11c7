"""The tokenizer service as the router uses it: a prompt, a conversation or a guided
choice to ids, before a generation. The text going the other way is the router's own
(services/generation/text.py)."""

from __future__ import annotations

import grpc

from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

TOKENIZER = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"]


class TokenizerClient:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

    async def tokenize(
        self, text: str, request_id: str, add_special_tokens: bool = True
    ) -> list[int]:
        """A prompt's ids; a guided choice's come as they follow the prompt, without
        special tokens (add_special_tokens=False)."""
        response = await self._stub.Tokenize(
            tokenizer_pb2.TokenizeRequest(
                request_id=request_id, text=text, add_special_tokens=add_special_tokens
            )
        )
        return list(response.token_ids)

    async def apply_chat_template(self, request_id: str, messages: list) -> list[int]:
        response = await self._stub.ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(
                request_id=request_id,
                messages=messages,
                add_generation_prompt=True,
                return_token_ids=True,
            )
        )
        return list(response.token_ids)
