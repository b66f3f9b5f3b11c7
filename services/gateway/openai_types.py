"""The request bodies of the OpenAI API, as pydantic models, and the parameters this
server refuses rather than ignores.

Unknown keys are accepted and ignored (clients send vendor extras; vLLM does the same),
but every OpenAI parameter that would change the answer and is not implemented here is
refused with a 400 naming it (`refuse_unsupported`): a client that asked for
log-probabilities or several choices must not get a plain answer that looks like success.

Nothing a body can hold reaches a proto unchecked: a string anywhere in it (a known key or
not, a key or a value) with a lone UTF-16 surrogate is refused, naming where it is, since
no UTF-8 encoder (protobuf's, the JSON response's) takes one; every integer is bounded by
the proto field it becomes (int32, uint64), every float is finite.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, FiniteFloat, model_validator
from pydantic_core import PydanticCustomError

from services.gateway.errors import encodable, invalid, unsupported

MAX_STOP_SEQUENCES = 4
# n: the choices share one prefill and decode side by side (SamplingParameters.n).
MAX_CHOICES = 16
# OpenAI's bound on top_logprobs, and the engines' (services.llm.requests).
MAX_TOP_LOGPROBS = 20
# The protos' integer ranges: max_new_tokens, top_n, steps, num_images and dimensions are
# int32; SamplingParameters.seed and diffusion's seed are uint64.
INT32_MAX = 2**31 - 1
MAX_SEED = 2**64 - 1
# OpenAI's bound on one embeddings request: each 32 is one call to the embedder, all at
# once, so a longer list would be a burst of calls from one request.
MAX_EMBEDDING_INPUTS = 2048
# vLLM's bound on cache_salt is none; this one keeps it a label, not a payload.
MAX_CACHE_SALT = 256

_SURROGATE = re.compile("[\ud800-\udfff]")


def _path(node: tuple[Any, str | int] | None) -> str:
    """A parameter path (`messages[0].content`) from its linked (parent, key) nodes."""
    parts: list[str] = []
    while node is not None:
        node, key = node
        parts.append(f"[{key}]" if isinstance(key, int) else f".{encodable(key)}")
    return "".join(reversed(parts)).removeprefix(".")


def _surrogate_in(text: str) -> re.Match[str] | None:
    return None if text.isascii() else _SURROGATE.search(text)


def lone_surrogate(body: dict[str, Any] | list[Any]) -> tuple[str, str, int] | None:
    """A lone UTF-16 surrogate in a parsed JSON body: (the parameter path of the string
    or key holding it, the surrogate, its index there); None when there is none. JSON's
    `\\ud800` escapes let a client send one and Python's json keeps it. Walked without
    recursion (a body may nest as deep as the JSON parser allows), strings checked where
    they are met, so a long list of them costs no stack entries."""
    stack: list[tuple[Any, tuple[Any, str | int] | None]] = [(body, None)]
    while stack:
        value, node = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            found = _surrogate_in(key) if isinstance(key, str) else None
            if found is None and isinstance(item, str):
                found = _surrogate_in(item)
            if found is not None:
                return _path((node, key)), found.group(), found.start()
            if isinstance(item, dict | list):
                stack.append((item, (node, key)))
    return None


def _printable(value: str) -> str:
    if not value.isprintable():
        raise PydanticCustomError(
            "not_printable", "must be printable: no control characters or line breaks"
        )
    return value


CacheSalt = Annotated[
    str, Field(min_length=1, max_length=MAX_CACHE_SALT), AfterValidator(_printable)
]
Int32 = Annotated[int, Field(le=INT32_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Request(_Body):
    """A whole request body: refused at once when any string in it is not valid Unicode,
    before a field is read (refused, not repaired: a replaced character would change the
    prompt, and the client could not know)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = lone_surrogate(data) if isinstance(data, dict) else None
        if found is not None:
            param, surrogate, at = found
            raise PydanticCustomError(
                "lone_surrogate",
                "holds a lone UTF-16 surrogate (U+{code} at character {at}); text must be "
                "valid Unicode, surrogates only in pairs",
                {"param": param, "code": f"{ord(surrogate):04X}", "at": at},
            )
        return data


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class ToolCall(_Body):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    # "developer" is OpenAI's newer name for "system"; the chat template knows "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Request):
    """What chat and completions share: sampling, stopping, the stream, and vLLM's
    `cache_salt` (prefix-cache isolation: requests share cached prefixes only with
    requests of the same tenant and salt; GenerateRequest.cache_salt)."""

    model: str = Field(min_length=1)
    max_tokens: Int32 | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    n: Int32 | None = Field(default=None, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, FiniteFloat] | None = None
    # The end user: the router's canary splits users by it (mesh.caller.USER_METADATA_KEY).
    user: str | None = Field(default=None, max_length=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None

    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def length(self) -> tuple[str, int] | None:
        """The length limit asked for and the parameter it came in."""
        if self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def refuse_unsupported(self) -> None:
        if self.n is not None and self.n > MAX_CHOICES:
            raise invalid("n", f"at most {MAX_CHOICES} choices")
        if self.presence_penalty:
            raise unsupported("presence_penalty", "must be 0: use frequency_penalty")
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "is only allowed with stream: true")
        stops = self.stop_sequences()
        if len(stops) > MAX_STOP_SEQUENCES:
            raise invalid("stop", f"at most {MAX_STOP_SEQUENCES} sequences")
        if any(not stop for stop in stops):
            raise invalid("stop", "sequences must not be empty")


def _refuse_set(body: _Body, names: tuple[str, ...]) -> None:
    """400 for the first of `names` the body sets (declared or not)."""
    given = {**(body.model_extra or {}), **body.model_dump(exclude_unset=True)}
    for name in names:
        if given.get(name) not in (None, False, [], {}):
            raise unsupported(name)


class JsonSchemaFormat(_Body):
    """response_format.json_schema. `schema` absent: any JSON object. `strict` changes
    nothing here: every schema is enforced token by token, strict or not."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(
                "json_schema", "json_schema is required with type json_schema, and only then"
            )
        return self


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Every schema is enforced token by token, strict or not.
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction

    @property
    def name(self) -> str:
        """The function named, as the Responses API's tool_choice names it."""
        return self.function.name


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def length(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().length()

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        _refuse_set(
            self, ("functions", "function_call", "audio", "prediction", "web_search_options")
        )
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "only ['text'] is supported")
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "requires logprobs: true")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: Int32 | None = Field(default=None, ge=1)
    suffix: str | None = None
    # The legacy API's logprobs: how many likely tokens beside each one (OpenAI allows 5,
    # vLLM 20; the engines report up to 20).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def alternatives(self) -> int | None:
        return self.logprobs

    def text(self) -> str:
        """The one prompt; token ids and batches of prompts are refused."""
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise invalid("prompt", "must be a string or a list of one string")
            prompt = prompt[0]
        return prompt

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise unsupported("echo")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "only best_of=1 is supported")
        if self.suffix:
            raise unsupported("suffix")


class EmbeddingRequest(_Request):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int32 | None = Field(default=None, ge=1)
    user: str | None = None

    def texts(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input]
        if not self.input:
            raise invalid("input", "must not be empty")
        if len(self.input) > MAX_EMBEDDING_INPUTS:
            raise invalid("input", f"at most {MAX_EMBEDDING_INPUTS} inputs, got {len(self.input)}")
        if not all(isinstance(item, str) for item in self.input):
            raise invalid("input", "token ids are not supported; send text")
        return list(self.input)  # type: ignore[arg-type]


class RerankDocument(_Body):
    text: str


class RerankRequest(_Request):
    """POST /v1/rerank, the shape Cohere, Jina and vLLM share: documents as strings or
    objects with a `text`. Long documents are truncated to the model's length, as theirs
    are."""

    model: str = Field(min_length=1)
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=1000)
    top_n: Int32 | None = Field(default=None, ge=1)
    return_documents: bool = True
    user: str | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def refuse_unsupported(self) -> None:
        _refuse_set(self, ("rank_fields", "max_chunks_per_doc"))


class ImageRequest(_Request):
    """POST /v1/images/generations. `seed`, `steps` and `conditioning` are aimesh's
    extensions (the openai SDK sends them in `extra_body`)."""

    model: str = Field(min_length=1)
    prompt: str = Field(max_length=1024)
    n: int = Field(default=1, ge=1, le=100)
    size: str | None = Field(default=None, pattern=r"^(auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$")
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png"] | None = None
    quality: str | None = None
    user: str | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    steps: Int32 | None = Field(default=None, ge=1)
    conditioning: dict[str, FiniteFloat] | None = None

    def dimensions(self) -> tuple[int, int] | None:
        """(width, height) asked for; None for the model's own size."""
        if self.size in (None, "auto"):
            return None
        width, height = self.size.split("x")
        return int(width), int(height)

    def refuse_unsupported(self) -> None:
        if self.response_format == "url":
            raise unsupported(
                "response_format",
                "url is not supported (this server keeps no images): use b64_json",
            )
        if self.quality not in (None, "auto", "standard"):
            raise unsupported("quality", "only 'standard' is supported")
        _refuse_set(self, ("style", "background", "output_compression", "stream", "partial_images"))


# POST /v1/responses (services/gateway/responses_api.py)


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedFunction(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class TextFormat(_Body):
    """text.format: `{"type": "json_schema", "name", "schema", "strict"}` flat, as the
    Responses API has it (chat nests it under `json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    max_output_tokens: Int32 | None = Field(default=None, ge=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    user: str | None = Field(default=None, max_length=128)

    def refuse_unsupported(self) -> None:
        if self.previous_response_id:
            raise unsupported(
                "previous_response_id", "this server keeps no responses: send the whole input"
            )
        _refuse_set(self, ("top_logprobs",))
