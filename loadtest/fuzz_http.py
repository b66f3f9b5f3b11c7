"""Hypothesis strategies for the gateway's HTTP surface: whole requests (method, path,
headers, body) on every route, for loadtest/fuzz_gateway.py and its test.

Most bodies are a small valid request of their route with up to three of its fields (or
nested fields: `messages[0].content`, `documents[1].text`) set to something hostile:
lone surrogates, integers at and past int32/int64/uint64, NaN and infinities, 4000-digit
and 5000-digit numbers, wrong types, deep nesting, long strings; or a field dropped, or an
unknown key added. The rest are any JSON value, garbage bytes, a valid body cut short,
brackets nested past the parser's depth, and valid bodies padded one byte past the
gateway's cap (`oversize`, built when sent). Bodies are written as ASCII JSON (a
surrogate as its `\\ud800` escape), as UTF-8 with the surrogates' own bytes, or as
UTF-16; some are sent chunked. Headers vary the content type, the key, the request id,
the trace context and an unknown header.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as seeded
from hypothesis import strategies as st

from loadtest.fuzz import HEADERS as TRACE_HEADERS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
IMAGES = "/v1/images/generations"
MODELS = "/v1/models"
USAGE = "/v1/usage"
POST_ROUTES = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS, RERANK, IMAGES)
GET_ROUTES = (MODELS, f"{MODELS}/{{model}}", USAGE, "/health", "/health/ready", "/health/live")
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
# The routes drawn from, the model routes (whose bodies are the surface) most often.
ROUTES = (*POST_ROUTES * 3, *GET_ROUTES, "/{junk}")


@dataclass(frozen=True)
class Models:
    """The model each surface serves (any name where the mesh serves none: the request is
    then a 404 after validation)."""

    chat: str
    embedding: str
    image: str
    rerank: str


@dataclass(frozen=True)
class HttpCase:
    """One request. `kind`: what its body is (KINDS, or "none"); `oversize`: the body is
    padded with JSON whitespace past the cap when sent; `chunked`: sent with
    Transfer-Encoding: chunked; `route`: the route it was drawn for (a report's row)."""

    kind: str
    method: str
    path: str
    headers: tuple[tuple[str, bytes], ...] = ()
    body: bytes | None = None
    chunked: bool = False
    oversize: bool = False
    route: str = field(default="", compare=False)

    def payload(self, max_body_bytes: int) -> bytes | None:
        if self.body is None or not self.oversize:
            return self.body
        return self.body + b" " * max(0, max_body_bytes + 1 - len(self.body))


class Raw:
    """A JSON token written as it is (a number no encoder writes: `1e400`, 5000 digits)."""

    def __init__(self, text: str) -> None:
        self.text = text


def encode(value: Any, how: str) -> bytes:
    """`value` as JSON: "ascii" (escapes, NaN and Infinity as Python writes them),
    "utf-8" (surrogates as their own bytes, as json.loads reads them back) or "utf-16"."""
    raws: list[str] = []

    def placeholder(obj: object) -> str:
        if isinstance(obj, Raw):
            raws.append(obj.text)
            return f"@@raw{len(raws) - 1}@@"
        raise TypeError(type(obj).__name__)

    text = json.dumps(value, ensure_ascii=how == "ascii", default=placeholder)
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw, 1)
    if how == "utf-16":
        return text.encode("utf-16", "surrogatepass")
    return text.encode("utf-8", "surrogatepass")


SURROGATES = st.characters(categories=["Cs"])
HOSTILE_TEXT = st.one_of(
    st.text(max_size=24),
    st.text(st.one_of(SURROGATES, st.characters()), min_size=1, max_size=12),
    st.sampled_from([
        "", " ", "\x00", "a\ud800b", "\udfff", "\ud83d\ude00", "🙂", "\u202e", "null", "0",
        "x" * 100_000, "é" * 20_000, "\n" * 1000,
    ]),
)  # fmt: skip
INT_EDGES = [
    0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
    2**64 - 1, 2**64, -(2**64), 10**30,
]  # fmt: skip
NUMBERS = st.one_of(
    st.sampled_from(INT_EDGES),
    st.integers(),
    st.floats(),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 5e-324]),
    st.sampled_from(["1e400", "-1e400", "9" * 4000, "1" + "0" * 5000, "1.5e-400"]).map(Raw),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, HOSTILE_TEXT)


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in `n` draws (st.integers(0, n - 1) == 0 would be true far more
    often: hypothesis favours the smallest values)."""
    return st.sampled_from([False] * (n - 1) + [True])


def _nested(depth: int) -> Raw:
    """Arrays `depth` deep, near the JSON parser's limit (written, not encoded: the
    encoder's own recursion would stop first)."""
    return Raw("[" * depth + "]" * depth)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(HOSTILE_TEXT, inner, max_size=4)


HOSTILE = st.one_of(
    SCALARS,
    st.recursive(SCALARS, _containers, max_leaves=12),
    st.sampled_from([[], {}, [None] * 5000, {"type": "text"}]),
    st.integers(100, 990).map(_nested),
)


def bases(models: Models) -> dict[str, dict[str, Any]]:
    """A small valid request per route (four tokens at most: the real model is slow)."""
    return {
        CHAT: {
            "model": models.chat,
            "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 3,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
                    },
                }
            ],
        },
        COMPLETIONS: {
            "model": models.chat,
            "prompt": "Once upon a time",
            "max_tokens": 4,
            "logprobs": 2,
        },
        RESPONSES: {
            "model": models.chat,
            "input": [{"role": "user", "content": "Say hi"}],
            "max_output_tokens": 4,
        },
        EMBEDDINGS: {"model": models.embedding, "input": ["a cat", "a dog"]},
        RERANK: {
            "model": models.rerank,
            "query": "which animal?",
            "documents": ["a cat", {"text": "a dog"}],
            "top_n": 1,
        },
        IMAGES: {"model": models.image, "prompt": "7", "n": 1, "seed": 1},
    }


# The fields a mutation may set or drop, per route: the models' own and a few they refuse.
FIELDS = {
    CHAT: [
        "model", "messages", "messages[0]", "messages[0].role", "messages[0].content",
        "messages[0].name", "messages[1]", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "stop", "seed", "n", "presence_penalty", "frequency_penalty",
        "logit_bias", "logprobs", "top_logprobs", "user", "stream", "stream_options",
        "response_format", "response_format.json_schema", "tools", "tools[0].function.name",
        "tools[0].function.parameters", "tools[1]", "tool_choice", "parallel_tool_calls",
        "messages[0].tool_calls", "messages[0].tool_call_id", "modalities", "cache_salt",
    ],
    RESPONSES: [
        "model", "input", "input[0]", "input[0].type", "input[0].role", "input[0].content",
        "input[1]", "instructions", "tools", "tool_choice", "text", "text.format",
        "max_output_tokens", "temperature", "top_p", "stream", "previous_response_id",
        "top_logprobs",
    ],
    COMPLETIONS: [
        "model", "prompt", "max_tokens", "echo", "best_of", "suffix", "stop", "seed",
        "temperature", "stream", "user", "cache_salt", "logprobs",
    ],
    EMBEDDINGS: ["model", "input", "input[0]", "encoding_format", "dimensions", "user"],
    RERANK: [
        "model", "query", "documents", "documents[0]", "documents[1].text", "top_n",
        "return_documents", "rank_fields",
    ],
    IMAGES: [
        "model", "prompt", "n", "size", "response_format", "seed", "steps", "conditioning",
        "quality", "style", "user",
    ],
}  # fmt: skip


def _parts(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in path.replace("]", "").replace("[", ".").split("."):
        parts.append(int(piece) if piece.isdigit() else piece)
    return parts


def _set(body: dict[str, Any], path: str, value: Any, drop: bool) -> None:
    """Sets (or drops) `path` in `body` where its parents exist; a list too short to hold
    the index gets the value appended."""
    *parents, last = _parts(path)
    target: Any = body
    for part in parents:
        try:
            target = target[part]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(target, dict) and isinstance(last, str):
        if drop:
            target.pop(last, None)
        else:
            target[last] = value
    elif isinstance(target, list) and isinstance(last, int):
        if last < len(target):
            if drop:
                del target[last]
            else:
                target[last] = value
        elif not drop:
            target.append(value)


@st.composite
def mutated(draw: st.DrawFn, route: str, models: Models) -> Any:
    body = json.loads(json.dumps(bases(models)[route]))
    for path in draw(st.lists(st.sampled_from(FIELDS[route]), max_size=3)):
        drop = draw(one_in(10))
        _set(body, path, None if drop else draw(HOSTILE), drop)
    if draw(one_in(10)):
        body[draw(HOSTILE_TEXT)] = draw(HOSTILE)
    return body


# Body kinds, the mutated valid request most often.
KINDS = ("mutated",) * 5 + ("json", "garbage", "cut", "nesting", "oversize")


@st.composite
def bodies(draw: st.DrawFn, route: str, models: Models) -> tuple[str, bytes, bool]:
    """(kind, bytes, oversize) for a body of `route`."""
    kind = draw(st.sampled_from(KINDS))
    encoding = draw(st.sampled_from(["ascii", "ascii", "utf-8", "utf-16"]))
    valid = json.dumps(bases(models)[route]).encode()
    if kind == "mutated":
        return kind, encode(draw(mutated(route, models)), encoding), False
    if kind == "json":
        return kind, encode(draw(HOSTILE), encoding), False
    if kind == "garbage":
        return kind, draw(st.binary(max_size=256)), False
    if kind == "cut":
        return kind, valid[: draw(st.integers(0, len(valid) - 1))], False
    if kind == "nesting":
        opening = draw(st.sampled_from([b"[", b'{"a":']))
        return kind, opening * draw(st.integers(500, 200_000)), False
    return kind, valid, True


_HEADER_VALUE = st.binary(max_size=64).map(
    lambda raw: bytes(b for b in raw if b == 9 or 32 <= b != 127).strip(b" \t")
)
_CONTENT_TYPES = st.sampled_from([
    b"application/json", b"application/json; charset=utf-8", b"APPLICATION/JSON",
    b"application/vnd.api+json", b"text/plain", b"", b"application/x-www-form-urlencoded",
    b"multipart/form-data; boundary=x", b"application/json; charset=latin-1",
])  # fmt: skip
_EXTRA_HEADERS = st.one_of(
    st.sampled_from([(name, value.encode()) for name, value in TRACE_HEADERS]),
    st.tuples(st.just("x-request-id"), _HEADER_VALUE),
    st.tuples(st.just("accept-encoding"), st.sampled_from([b"gzip", b"br", b"*;q=x"])),
    st.tuples(st.from_regex(r"x-[a-z0-9-]{1,20}", fullmatch=True), _HEADER_VALUE),
)


@st.composite
def headers(draw: st.DrawFn, key: str | None) -> tuple[tuple[str, bytes], ...]:
    """Mostly JSON with the right key (when the gateway asks for one); now and then
    another content type, a wrong or garbled key, trace context, an unknown header."""
    sent: list[tuple[str, bytes]] = []
    if not draw(one_in(5)):
        sent.append(("content-type", b"application/json"))
    elif draw(st.booleans()):
        sent.append(("content-type", draw(_CONTENT_TYPES | _HEADER_VALUE)))
    if key is not None and not draw(one_in(8)):
        sent.append(("authorization", b"Bearer " + key.encode()))
    elif draw(st.booleans()):
        sent.append(("authorization", (b"Bearer " + draw(_HEADER_VALUE)).strip()))
    sent += draw(st.lists(_EXTRA_HEADERS, max_size=2))
    return tuple(sent)


@st.composite
def http_cases(draw: st.DrawFn, models: Models, key: str | None = None) -> HttpCase:
    """Any request to any route: mostly the route's own method, sometimes another."""
    route = draw(st.sampled_from(ROUTES))
    method = "POST" if route in POST_ROUTES else "GET"
    if draw(one_in(10)):
        method = draw(st.sampled_from(METHODS))
    path = route.format(
        model=quote(draw(HOSTILE_TEXT)[:200], safe="", errors="surrogatepass"),
        junk=quote(draw(HOSTILE_TEXT)[:200], safe="/", errors="surrogatepass"),
    )
    kind, body, oversize = ("none", None, False)
    if method in ("POST", "PUT", "PATCH") or draw(one_in(20)):
        kind, body, oversize = draw(bodies(route if route in POST_ROUTES else CHAT, models))
    return HttpCase(
        kind=kind,
        method=method,
        path=path,
        headers=draw(headers(key)),
        body=body,
        chunked=body is not None and draw(one_in(5)),
        oversize=oversize,
        route=route,
    )


def draw_cases(strategy: st.SearchStrategy[HttpCase], count: int, seed: int) -> list[HttpCase]:
    """`count` examples of `strategy`, the same for the same seed (and hypothesis
    version): hypothesis as the generator, nothing shrunk, nothing stored."""
    drawn: list[HttpCase] = []

    @seeded(seed)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(case: HttpCase) -> None:
        drawn.append(case)

    collect()
    return drawn
