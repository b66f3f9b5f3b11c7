"""The request bodies of the OpenAI API, as pydantic models, and the parameters this
server refuses rather than ignores.

Unknown keys are accepted and ignored (clients send vendor extras; vLLM does the same),
but every OpenAI parameter that would change the answer and is not implemented here is
refused with a 400 naming it (`refuse_unsupported`): a client that asked for tools or
log-probabilities must not get a plain answer that looks like success.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.errors import invalid, unsupported

MAX_STOP_SEQUENCES = 4
# The largest seed the mesh's sampler takes (SamplingParameters.seed is a uint64).
MAX_SEED = 2**64 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    # "developer" is OpenAI's newer name for "system"; the chat template knows "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """What chat and completions share: sampling, stopping and the stream."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    n: int | None = Field(default=None, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    # The end user: the router's canary splits users by it (mesh.caller.USER_METADATA_KEY).
    user: str | None = Field(default=None, max_length=128)
    # vLLM's: scopes the prefix cache further than the tenant (GenerateRequest.cache_salt).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None

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
        if self.n not in (None, 1):
            raise unsupported("n", "only n=1 is supported; send n requests instead")
        if self.presence_penalty:
            raise unsupported("presence_penalty", "must be 0: use frequency_penalty")
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.logprobs not in (None, False, 0) or self.top_logprobs:
            raise unsupported("logprobs" if self.logprobs else "top_logprobs")
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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None

    def length(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().length()

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        _refuse_set(
            self,
            ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
             "audio", "prediction", "web_search_options"),
        )  # fmt: skip
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise unsupported("response_format", "only {'type': 'text'} is supported")
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "only ['text'] is supported")
        for i, message in enumerate(self.messages):
            if message.tool_calls:
                raise unsupported(f"messages[{i}].tool_calls")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

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


class EmbeddingRequest(_Body):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def texts(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input]
        if not self.input:
            raise invalid("input", "must not be empty")
        if not all(isinstance(item, str) for item in self.input):
            raise invalid("input", "token ids are not supported; send text")
        return list(self.input)  # type: ignore[arg-type]


class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    """POST /v1/rerank, the shape Cohere, Jina and vLLM share: documents as strings or
    objects with a `text`. Long documents are truncated to the model's length, as theirs
    are."""

    model: str = Field(min_length=1)
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=1000)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    user: str | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def refuse_unsupported(self) -> None:
        _refuse_set(self, ("rank_fields", "max_chunks_per_doc"))


class ImageRequest(_Body):
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
    steps: int | None = Field(default=None, ge=1)
    conditioning: dict[str, float] | None = None

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
