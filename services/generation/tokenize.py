"""The tokenizer service as the router uses it: a prompt, a conversation or a guided
choice to ids, before a generation. The text going the other way is the router's own
(services/generation/text.py)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from aimesh.common.v1 import common_pb2
from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh.errors import field_violations
from mesh.failures import InvalidInput

TOKENIZER = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"]


@dataclass(frozen=True)
class Template:
    """What the model's chat template can render: how it writes tool calls
    (tokenizer_pb2.ToolFormat) and which roles it knows."""

    tool_format: int
    roles: frozenset[str]


class TokenizerClient:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        self._template: Template | None = None

    async def template(self, request_id: str) -> Template:
        """The chat template's abilities, asked of the tokenizer once: a template does not
        change while its service runs."""
        if self._template is None:
            response = await self._stub.ApplyChatTemplate(
                tokenizer_pb2.ApplyChatTemplateRequest(
                    request_id=request_id,
                    messages=[common_pb2.ChatMessage(role="user", content="hi")],
                )
            )
            self._template = Template(response.tool_format, frozenset(response.roles))
        return self._template

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

    async def apply_chat_template(
        self, request_id: str, messages: list, tools: str = ""
    ) -> list[int]:
        """A conversation's prompt ids; `tools` (OpenAI's JSON array) for a template that
        renders them itself. What the template refuses of the conversation (a role it
        does not know, turns that do not alternate) is the caller's error, as the
        tokenizer names it."""
        try:
            response = await self._stub.ApplyChatTemplate(
                tokenizer_pb2.ApplyChatTemplateRequest(
                    request_id=request_id,
                    messages=messages,
                    add_generation_prompt=True,
                    return_token_ids=True,
                    tools=tools,
                )
            )
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            raise InvalidInput(field_violations(error)) from None
        return list(response.token_ids)
