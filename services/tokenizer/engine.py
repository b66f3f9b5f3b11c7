"""The model's tokenizer and chat template as plain Python: no grpc, inputs already valid.

Tokenizing goes straight to the Rust `tokenizers.Tokenizer` behind the transformers
tokenizer: its `encode_batch` releases the GIL (plain `encode` does not), so a long text
tokenized in a worker thread leaves the event loop free, and it never mutates the tokenizer
(transformers' `__call__` resets truncation and padding on every call, which fails with
"Already borrowed" when two threads tokenize at once). Decoding and the chat template go
through transformers so the text is exactly what `tokenizer.decode` and
`tokenizer.apply_chat_template` give.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from aimesh.tokenizer.v1 import tokenizer_pb2
from mesh.failures import FieldViolation, InvalidInput, NotReady
from services.tokenizer.detokenize import IncrementalDetokenizer

TOOL_FORMAT_UNSPECIFIED = tokenizer_pb2.TOOL_FORMAT_UNSPECIFIED
# Accepted when the template does not say which roles it knows (it renders any role).
DEFAULT_ROLES = frozenset({"system", "user", "assistant", "tool"})
# A role no template names: a template that renders it accepts every role.
_PROBE_ROLE = "aimesh-probe-role"
# `message['role'] == 'user'`, `message.role != "system"` and the like in template source.
_ROLE_LITERAL = re.compile(r"""role['"]?\]?\s*[!=]=\s*['"]([^'"]+)['"]""")


@dataclass(frozen=True)
class Tokenized:
    """Token ids of a text; tokens and offsets (code points, end exclusive) only on request."""

    ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation; ids is empty unless they were asked for."""

    text: str
    ids: list[int]


class TokenizerEngine:
    """One model's tokenizer; safe to call from several threads at once."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        # len() counts added tokens (chat markers) too, unlike tokenizer.vocab_size.
        self.vocab_size = len(tokenizer)
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.roles = _accepted_roles(tokenizer)
        self.tool_format = tool_format_of(tokenizer.chat_template)

    @classmethod
    def load(cls, directory: Path, chat_template: Path | None = None) -> TokenizerEngine:
        """Loads the fast tokenizer of a local model directory; never touches the network.
        `chat_template`: a Jinja file that replaces the model's own template (or gives
        one to a model without)."""
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        if not hasattr(tokenizer, "backend_tokenizer"):
            raise NotReady(f"{directory} has no fast tokenizer (tokenizer.json)")
        if chat_template is not None:
            try:
                tokenizer.chat_template = chat_template.read_text()
            except (OSError, UnicodeDecodeError) as error:
                raise NotReady(f"cannot read the chat template {chat_template}: {error}") from error
        return cls(tokenizer)

    def tokenize(self, text: str, add_special_tokens: bool, return_details: bool) -> Tokenized:
        (encoding,) = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        if not return_details:
            return Tokenized(encoding.ids, [], [])
        return Tokenized(encoding.ids, encoding.tokens, encoding.offsets)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_detokenizer(self, skip_special_tokens: bool) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            partial(self.detokenize, skip_special_tokens=skip_special_tokens)
        )

    def apply_chat_template(
        self,
        messages: Iterable[tuple[str, str] | dict[str, Any]],
        add_generation_prompt: bool,
        return_token_ids: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> ChatPrompt:
        """Renders the turns ((role, content) pairs, or messages in OpenAI's shape, tool
        calls included) and, where the template knows tools, `tools` (OpenAI's shape);
        the ids never get special tokens added again, because the template already wrote
        them into the text."""
        if self._tokenizer.chat_template is None:
            violation = FieldViolation(
                "messages",
                "the model has no chat template: send a prompt to completions, or configure "
                "[engines.llm] chat_template",
            )
            raise InvalidInput([violation])
        conversation = [
            m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages
        ]
        offered = tools if tools and self.tool_format != TOOL_FORMAT_UNSPECIFIED else None
        try:
            text = self._tokenizer.apply_chat_template(
                conversation,
                tools=offered,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as error:
            # Only the template knows some of its rules (turns that must alternate, a
            # system message that must come first); it says so by raising.
            violation = FieldViolation("messages", f"the chat template refuses them: {error}")
            raise InvalidInput([violation]) from error
        ids = self.tokenize(text, False, False).ids if return_token_ids else []
        return ChatPrompt(text, ids)


def tool_format_of(template: str | dict[str, str] | None) -> int:
    """How a chat template has the model write tool calls, read from its source as
    llama.cpp's common/chat.cpp tells templates apart, in its order: one that renders
    `tools` and writes `<tool_call>` tags is Hermes's format (Qwen 2.5 and 3 among
    them); one with an `ipython` turn is Llama 3.1's (and 3.2's and 3.3's)."""
    if template is None:
        return TOOL_FORMAT_UNSPECIFIED
    source = template if isinstance(template, str) else " ".join(template.values())
    if "<tool_call>" in source and "tools" in source:
        return tokenizer_pb2.TOOL_FORMAT_HERMES
    if "<|start_header_id|>ipython<|end_header_id|>" in source:
        return tokenizer_pb2.TOOL_FORMAT_LLAMA3
    return TOOL_FORMAT_UNSPECIFIED


def _accepted_roles(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The roles the chat template renders, found by asking it.

    A template that renders a made-up role accepts any role, so nothing narrower than the
    usual roles can be determined. One that refuses it accepts those of the roles it names
    and the usual ones that it renders.
    """
    template = tokenizer.chat_template
    if template is None or _renders(tokenizer, _PROBE_ROLE):
        return DEFAULT_ROLES
    source = template if isinstance(template, str) else " ".join(template.values())
    candidates = DEFAULT_ROLES | set(_ROLE_LITERAL.findall(source))
    return frozenset(role for role in candidates if _renders(tokenizer, role))


def _renders(tokenizer: PreTrainedTokenizerBase, role: str) -> bool:
    """Whether a turn of `role` renders first or after a user turn: templates that insist
    on alternating turns refuse an assistant turn first."""
    for roles in ([role], ["user", role]):
        conversation = [{"role": each, "content": "probe"} for each in roles]
        try:
            tokenizer.apply_chat_template(conversation, tokenize=False)
        except TemplateError:
            continue
        return True
    return False
