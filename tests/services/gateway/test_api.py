"""The gateway's OpenAI surface against scripted stand-ins for generation and the
embedder (real MeshServers on loopback): the SSE contract, the error table, keys and
scopes, embeddings batching, and cancellation when the client goes away. Parameters
refused by name: test_validation.py; the real model behind it: test_llm_gateway.py."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest

from mesh.keys import digest
from tests.conftest import eventually, metric
from tests.services.gateway.conftest import KEY, KEYS, start_gateway, write_keys
from tests.services.gateway.fakes import EMBEDDING_MODEL, IMAGE_MODEL, LLM, vector

pytestmark = pytest.mark.service

USER = [{"role": "user", "content": "hi there"}]


def chat(content: str = "hi there", **extra) -> dict:
    return {"model": LLM, "messages": [{"role": "user", "content": content}], **extra}


async def sse_events(response: httpx.Response) -> list[str]:
    """The raw `data:` payloads of a stream, checking the framing of each event."""
    body = b"".join([part async for part in response.aiter_raw()]).decode()
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    return [event.removeprefix("data: ") for event in events]


async def stream(gateway, path: str, body: dict) -> list[str]:
    async with gateway.http() as client, client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        return await sse_events(response)


async def test_a_streamed_chat_follows_openais_event_contract(gateway):
    events = await stream(
        gateway, "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True})
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
    finished = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finished] == ["stop"]
    *content, usage = chunks
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 4,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert all(chunk["usage"] is None for chunk in content)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == "Hello, world!"


async def test_without_include_usage_there_is_no_usage_event(gateway):
    events = await stream(gateway, "/v1/chat/completions", chat(stream=True))
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["choices"] and "usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_the_sdk_gets_the_same_text_streamed_and_whole(gateway):
    client = gateway.sdk()
    whole = await client.chat.completions.create(model=LLM, messages=USER, seed=3)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    streamed = await client.chat.completions.create(model=LLM, messages=USER, seed=3, stream=True)
    parts = [chunk.choices[0].delta.content or "" async for chunk in streamed if chunk.choices]
    assert "".join(parts) == whole.choices[0].message.content == "Hello, world!"


async def test_a_length_limit_finishes_with_length(gateway):
    client = gateway.sdk()
    answer = await client.chat.completions.create(model=LLM, messages=USER, max_tokens=2)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (
        "Hello,",
        "length",
    )
    sent = gateway.generation.requests[-1]
    assert sent.stopping.max_new_tokens == 2
    assert sent.sampling.temperature == 1.0  # OpenAI's default, not the proto's greedy 0


async def test_completions_stream_and_whole(gateway):
    client = gateway.sdk()
    whole = await client.completions.create(model=LLM, prompt="Once upon", stop=["x", "y"])
    assert whole.object == "text_completion"
    assert whole.choices[0].text == "Hello, world!"
    assert list(gateway.generation.requests[-1].stopping.stop_sequences) == ["x", "y"]
    events = await stream(
        gateway,
        "/v1/completions",
        {
            "model": LLM,
            "prompt": "Once upon",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == "Hello"  # no role event for completions
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello, world!"
    assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_chat_logprobs_whole_and_streamed_in_openais_shape(gateway):
    client = gateway.sdk()
    whole = await client.chat.completions.create(
        model=LLM, messages=USER, logprobs=True, top_logprobs=2
    )
    sent = gateway.generation.requests[-1].sampling
    assert (sent.logprobs, sent.top_logprobs) == (True, 2)
    content = whole.choices[0].logprobs.content
    assert [entry.token for entry in content] == ["Hello", ",", " world", "!"]
    assert bytes(b for entry in content for b in entry.bytes).decode() == "Hello, world!"
    assert content[0].logprob == pytest.approx(-0.5)
    assert [t.token for t in content[2].top_logprobs] == [" world0", " world1"]
    streamed = await client.chat.completions.create(
        model=LLM, messages=USER, logprobs=True, stream=True
    )
    entries = [
        entry
        async for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]
    assert all(e.top_logprobs == [] for e in entries)
    plain = await client.chat.completions.create(model=LLM, messages=USER)
    assert plain.choices[0].logprobs is None
    assert not gateway.generation.requests[-1].sampling.logprobs


async def test_completions_logprobs_are_the_legacy_columns(gateway):
    client = gateway.sdk()
    whole = await client.completions.create(model=LLM, prompt="Once upon", logprobs=1)
    logprobs = whole.choices[0].logprobs
    assert logprobs.tokens == ["Hello", ",", " world", "!"]
    assert logprobs.text_offset == [0, 5, 6, 12]
    assert logprobs.top_logprobs[2] == {" world0": pytest.approx(-0.6)}
    events = await stream(
        gateway, "/v1/completions", {"model": LLM, "prompt": "x", "stream": True, "logprobs": 0}
    )
    choices = [json.loads(event)["choices"][0] for event in events[:-1]]
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == [0, 5, 6, 12]
    assert choices[-1]["finish_reason"] == "stop" and choices[-1]["logprobs"] is None


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("INVALID_ARGUMENT", 400, "invalid_request_error"),
        ("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
        ("UNAVAILABLE", 503, "service_unavailable_error"),
        ("DEADLINE_EXCEEDED", 504, "timeout_error"),
        ("INTERNAL", 500, "server_error"),
    ],
)
async def test_mesh_statuses_become_http_statuses(gateway, code, status, kind, streamed):
    """Before the first token, a refusal is the real status even when streaming."""
    async with gateway.http() as client:
        response = await client.post(
            "/v1/chat/completions", json=chat(f"refuse:{code}", stream=streamed)
        )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == kind
    if code == "INVALID_ARGUMENT":  # the router's field, in the request's words
        assert error["param"] == "max_tokens"
        assert error["message"].startswith("max_tokens: exceeds the context window")
    if code == "RESOURCE_EXHAUSTED":
        assert response.headers["retry-after-ms"] == "2500"
        assert response.headers["retry-after"] == "3"
    if code == "INTERNAL":
        assert "secret" not in error["message"]


async def test_the_sdk_honours_retry_after_ms(gateway):
    client = gateway.sdk(max_retries=1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(
            model=LLM, messages=[{"role": "user", "content": "refuse:RESOURCE_EXHAUSTED"}]
        )
    assert loop.time() - started >= 2.5
    assert len(gateway.generation.requests) == 2


async def test_a_failure_mid_stream_is_an_error_event_then_done(gateway):
    events = await stream(gateway, "/v1/chat/completions", chat("midstream", stream=True))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error"
    chunks = [json.loads(event) for event in events[:-2]]
    assert chunks[1]["choices"][0]["delta"]["content"] == "partial"
    assert not any(c["choices"][0]["finish_reason"] for c in chunks)
    with pytest.raises(openai.APIError, match="decode died"):
        async for _ in await gateway.sdk().chat.completions.create(
            model=LLM, messages=[{"role": "user", "content": "midstream"}], stream=True
        ):
            pass


async def test_non_ascii_and_extra_fields_are_fine(gateway):
    messages = [
        {"role": "developer", "content": "Réponds en français 🙂", "x-vendor": 1},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Grüße, "}, {"type": "text", "text": "日本"}],
        },
    ]
    answer = await gateway.sdk().chat.completions.create(
        model=LLM, messages=messages, extra_body={"top_k": 5}
    )
    assert answer.choices[0].message.content == "Hello, world!"
    sent = gateway.generation.requests[-1].messages
    assert [(m.role, m.content) for m in sent] == [
        ("system", "Réponds en français 🙂"),
        ("user", "Grüße, 日本"),
    ]


async def test_response_format_becomes_the_constraint_the_engines_enforce(gateway):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats = [
        ({"type": "json_object"}, "json_object", True),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            "json_schema",
            schema,
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "strict": True}},
            "json_object",
            True,
        ),
        ({"type": "text"}, None, None),
    ]
    client = gateway.sdk()
    for response_format, kind, value in formats:
        await client.chat.completions.create(
            model=LLM, messages=USER, response_format=response_format
        )
        constraint = gateway.generation.requests[-1].sampling.constraint
        assert constraint.WhichOneof("kind") == kind
        if kind == "json_schema":
            assert json.loads(constraint.json_schema) == value
        elif kind is not None:
            assert getattr(constraint, kind) == value


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}


async def test_tools_choice_and_the_conversations_calls_reach_the_router(gateway):
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "4 C"},
    ]
    client = gateway.sdk()
    choices = [
        ("auto", ("mode", 1)),
        ("none", ("mode", 2)),
        ("required", ("mode", 3)),
        ({"type": "function", "function": {"name": "get_weather"}}, ("function", "get_weather")),
    ]
    for choice, expected in choices:
        await client.chat.completions.create(
            model=LLM,
            messages=history,
            tools=[WEATHER_TOOL],
            tool_choice=choice,
            parallel_tool_calls=False,
        )
        sent = gateway.generation.requests[-1]
        field = sent.tool_choice.WhichOneof("choice")
        assert (field, getattr(sent.tool_choice, field)) == expected
    assert sent.parallel_tool_calls is False and sent.HasField("parallel_tool_calls")
    (tool,) = sent.tools
    assert (tool.name, tool.description) == ("get_weather", "The weather in a city.")
    assert json.loads(tool.parameters) == WEATHER_TOOL["function"]["parameters"]
    assistant, answer = sent.messages[1], sent.messages[2]
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call_9", "get_weather", '{"city": "Oslo"}')
    ]
    assert (answer.role, answer.tool_call_id, answer.content) == ("tool", "call_9", "4 C")


async def test_tool_calls_come_back_whole_and_as_openais_stream_deltas(gateway):
    client = gateway.sdk()
    messages = [{"role": "user", "content": "call:get_weather"}]
    whole = await client.chat.completions.create(model=LLM, messages=messages, tools=[WEATHER_TOOL])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_1", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    stream = await client.chat.completions.create(
        model=LLM, messages=messages, tools=[WEATHER_TOOL], stream=True
    )
    deltas = [c.choices[0].delta.tool_calls async for c in stream if c.choices[0].delta.tool_calls]
    first = deltas[0][0]
    assert (first.index, first.id, first.function.name) == (0, "call_1", "get_weather")
    assert "".join(d[0].function.arguments or "" for d in deltas) == call.function.arguments
    assert all(d[0].id is None for d in deltas[1:])


async def test_n_choices_each_with_its_index_and_seed_whole_and_streamed(gateway):
    client = gateway.sdk()
    whole = await client.chat.completions.create(
        model=LLM, messages=USER, n=3, seed=41, temperature=0.8
    )
    # One call for the three (the router prefills once and seeds choice i with 41 + i).
    asked = gateway.generation.requests[-1].sampling
    assert (asked.n, asked.seed) == (3, 41)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert {c.message.content for c in whole.choices} == {"Hello, world!"}
    single = await client.chat.completions.create(model=LLM, messages=USER)
    # The prompt counted once, every choice's tokens.
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens
    assert whole.usage.completion_tokens == 3 * single.usage.completion_tokens
    stream = await client.chat.completions.create(
        model=LLM,
        messages=USER,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usage = {}, [], None
    async for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            finishes.append(choice.index)
    assert texts == {0: "Hello, world!", 1: "Hello, world!", 2: "Hello, world!"}
    assert sorted(finishes) == [0, 1, 2]
    assert usage.completion_tokens == whole.usage.completion_tokens


async def test_the_responses_api_answers_calls_and_shapes_output(gateway):
    client = gateway.sdk()
    answer = await client.responses.create(
        model=LLM, input="hi there", instructions="Be brief.", max_output_tokens=50
    )
    assert answer.output_text == "Hello, world!" and answer.status == "completed"
    assert answer.usage.output_tokens > 0 and answer.usage.input_tokens > 0
    sent = gateway.generation.requests[-1]
    assert [(m.role, m.content) for m in sent.messages] == [
        ("system", "Be brief."),
        ("user", "hi there"),
    ]
    assert sent.stopping.max_new_tokens == 50
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    called = await client.responses.create(
        model=LLM, input="call:get_weather", tools=[tool], tool_choice="required"
    )
    (call,) = called.output
    assert (call.type, call.call_id, call.name) == ("function_call", "call_1", "get_weather")
    assert json.loads(call.arguments) == {"city": "Oslo"}
    assert gateway.generation.requests[-1].tool_choice.mode == 3
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c7", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c7", "output": "4 C"},
    ]
    await client.responses.create(
        model=LLM,
        input=history,
        tools=[tool],
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    )
    sent = gateway.generation.requests[-1]
    assert [(m.role, m.content, m.tool_call_id) for m in sent.messages] == [
        ("user", "Weather?", ""),
        ("assistant", "", ""),
        ("tool", "4 C", "c7"),
    ]
    assert [(c.id, c.name) for c in sent.messages[1].tool_calls] == [("c7", "get_weather")]
    assert json.loads(sent.sampling.constraint.json_schema) == {"type": "object"}
    async with gateway.http() as raw:
        stored = await raw.post(
            "/v1/responses", json={"model": LLM, "input": "x", "previous_response_id": "resp_1"}
        )
        odd = await raw.post("/v1/responses", json={"model": LLM, "input": [{"type": "reasoning"}]})
        likely = await raw.post(
            "/v1/responses", json={"model": LLM, "input": "x", "top_logprobs": 2}
        )
    assert [r.json()["error"]["param"] for r in (stored, odd, likely)] == [
        "previous_response_id",
        "input[0].type",
        "top_logprobs",
    ]
    assert {r.status_code for r in (stored, odd, likely)} == {400}
    named = {"type": "function", "name": "get_weather"}
    answer = await client.responses.create(
        model=LLM, input="call:get_weather", tool_choice=named, tools=[tool]
    )
    assert answer.tool_choice.name == "get_weather"


async def test_the_responses_api_streams_the_apis_own_events(gateway):
    client = gateway.sdk()
    kinds, deltas = [], []
    async with client.responses.stream(model=LLM, input="hi there") as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "".join(deltas) == final.output_text == "Hello, world!"
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    events = [
        event
        async for event in await client.responses.create(
            model=LLM, input="call:get_weather", tools=[tool], stream=True
        )
    ]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.call_id, i.name) for i in added] == [
        ("function_call", "call_1", "get_weather")
    ]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    (completed,) = [e for e in events if e.type == "response.completed"]
    (call,) = completed.response.output
    assert arguments == call.arguments == '{"city": "Oslo"}'
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_keys_and_scopes(gateway):
    async with gateway.http(key=None) as anonymous:
        missing = await anonymous.post("/v1/chat/completions", json=chat())
        models = await anonymous.get("/v1/models")
        health = await anonymous.get("/health")
        metrics = await anonymous.get("/metrics")
    assert missing.status_code == 401 and models.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    assert (health.status_code, metrics.status_code) == (200, 200)
    with pytest.raises(openai.AuthenticationError):
        await gateway.sdk("sk-wrong").models.list()
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await gateway.sdk("sk-embed-only").chat.completions.create(model=LLM, messages=USER)
    assert denied.value.body["type"] == "permission_error"
    embedded = await gateway.sdk("sk-embed-only").embeddings.create(
        model=EMBEDDING_MODEL, input="x"
    )
    assert len(embedded.data) == 1
    assert not gateway.generation.requests


async def test_a_rotated_key_file_applies_without_a_restart(gateway):
    client = gateway.sdk("sk-new")
    with pytest.raises(openai.AuthenticationError):
        await client.models.list()
    write_keys(gateway.keys_file, {"sk-new": ("newco", ["generate"])})
    assert len((await client.models.list()).data) == 3
    with pytest.raises(openai.AuthenticationError):
        await gateway.sdk("sk-everything").models.list()
    gateway.keys_file.write_text("{half a file")  # a broken rotation keeps the last keys
    assert len((await client.models.list()).data) == 3


async def test_keys_never_reach_the_log(gateway, caplog):
    caplog.set_level("DEBUG")
    await gateway.sdk().chat.completions.create(model=LLM, messages=USER)
    with pytest.raises(openai.AuthenticationError):
        await gateway.sdk("sk-leaky-secret").models.list()
    assert "sk-" not in caplog.text and digest("sk-leaky-secret") not in caplog.text


async def test_models_and_unknown_models(gateway):
    client = gateway.sdk()
    assert [m.id for m in (await client.models.list()).data] == [LLM, EMBEDDING_MODEL, IMAGE_MODEL]
    assert (await client.models.retrieve(LLM)).id == LLM
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-17")
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.chat.completions.create(model="gpt-17", messages=USER)
    assert unknown.value.body["code"] == "model_not_found"
    async with gateway.http() as http:
        nowhere = await http.get("/v1/nowhere")
    assert nowhere.status_code == 404 and nowhere.json()["error"]["type"] == "not_found_error"


async def test_embeddings_match_the_embedders_vectors_in_both_encodings(gateway):
    texts = [f"text number {i}" for i in range(40)]  # two Embed calls of at most 32
    answer = await gateway.sdk().embeddings.create(model=EMBEDDING_MODEL, input=texts)
    assert [d.index for d in answer.data] == list(range(40))
    assert [d.embedding for d in answer.data] == [vector(t) for t in texts]
    assert answer.usage.prompt_tokens == 40
    assert gateway.embedder.calls == 2
    async with gateway.http() as client:
        floats = await client.post(
            "/v1/embeddings",
            json={"model": EMBEDDING_MODEL, "input": "one", "encoding_format": "float"},
        )
    assert floats.json()["data"][0]["embedding"] == vector("one")


async def test_embedding_errors_name_the_input_in_the_requests_numbering(gateway):
    texts = ["fine"] * 33 + ["refuse"]
    async with gateway.http() as client:
        bad = await client.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": texts})
        ids = await client.post(
            "/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": [[1, 2]]}
        )
        dims = await client.post(
            "/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "a", "dimensions": 2}
        )
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "input[33]")
    assert (ids.status_code, ids.json()["error"]["param"]) == (400, "input")
    assert (dims.status_code, dims.json()["error"]["param"]) == (400, "dimensions")


@pytest.mark.parametrize("script", ["forever", "stall"])
async def test_a_client_that_goes_away_cancels_the_generation(gateway, script):
    """Mid-stream, and before the first byte (a request still waiting for its token)."""
    before = metric(
        "aimesh_gateway_client_disconnects_total", route="/v1/chat/completions", reason="disconnect"
    )
    async with gateway.http() as client:
        request = client.build_request(
            "POST", "/v1/chat/completions", json=chat(script, stream=True)
        )
        if script == "forever":
            response = await client.send(request, stream=True)
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            await eventually(lambda: gateway.generation.running == 1)
            await response.aclose()
        else:
            sending = asyncio.create_task(client.send(request, stream=True))
            await eventually(lambda: gateway.generation.running == 1)
            sending.cancel()
    await eventually(lambda: gateway.generation.running == 0)
    assert gateway.generation.cancelled == 1
    await eventually(
        lambda: (
            metric(
                "aimesh_gateway_client_disconnects_total",
                route="/v1/chat/completions",
                reason="disconnect",
            )
            == before + 1
        )
    )


async def test_the_request_id_trace_and_tenant_travel_to_the_mesh(gateway, spans):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"x-request-id": "req-42", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    async with gateway.http() as client:
        response = await client.post("/v1/chat/completions", json=chat(), headers=headers)
    assert response.headers["x-request-id"] == "req-42"
    assert gateway.generation.requests[-1].request_id == "req-42"
    metadata = gateway.generation.metadata[-1]
    assert metadata["x-request-id"] == "req-42"
    assert metadata["x-aimesh-client"] == KEYS["sk-everything"][0]
    assert metadata["traceparent"].split("-")[1] == trace_id
    names = {
        s.name for s in spans.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id
    }
    assert "POST /v1/chat/completions" in names


async def test_a_cache_salt_reaches_the_router_with_the_tenant(gateway):
    """vLLM's parameter, as the openai SDK sends it (extra_body), on chat and completions:
    the router scopes prefill's cache by the tenant it is sent for and this salt."""
    client = gateway.sdk()
    await client.chat.completions.create(
        model=LLM, messages=USER, extra_body={"cache_salt": "user-17"}
    )
    assert gateway.generation.requests[-1].cache_salt == "user-17"
    assert gateway.generation.metadata[-1]["x-aimesh-client"] == KEYS[KEY][0]
    await client.completions.create(model=LLM, prompt="hi", extra_body={"cache_salt": "s2"})
    assert gateway.generation.requests[-1].cache_salt == "s2"
    await client.completions.create(model=LLM, prompt="hi")
    assert gateway.generation.requests[-1].cache_salt == ""


async def test_past_its_slots_the_gateway_answers_429_before_calling_the_mesh(tmp_path):
    gateway, servers = await start_gateway(tmp_path, max_concurrency=1, max_queue=0)
    try:
        async with gateway.http() as client:
            request = client.build_request(
                "POST", "/v1/chat/completions", json=chat("forever", stream=True)
            )
            holding = await client.send(request, stream=True)
            refused = await client.post("/v1/chat/completions", json=chat())
            await holding.aclose()
        assert refused.status_code == 429
        assert float(refused.headers["retry-after-ms"]) > 0
        assert len(gateway.generation.requests) == 1
    finally:
        for server in servers:
            await server.drain(0)


async def test_readiness_follows_the_dependencies(tmp_path):
    gateway, (server, generation, embedder, diffusion) = await start_gateway(tmp_path)
    try:
        async with gateway.http(key=None) as client:
            assert (await client.get("/health/ready")).status_code == 200
            await generation.drain(0)
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 10
            while (ready := await client.get("/health/ready")).status_code == 200:
                assert loop.time() < give_up, "still ready 10 s after generation stopped"
                await asyncio.sleep(0.05)
            assert ready.status_code == 503
            assert (await client.get("/health/live")).status_code == 200
    finally:
        for each in (server, embedder, diffusion):
            await each.drain(0)


async def test_accepted_connections_send_without_delay(gateway):
    """TCP_NODELAY on every accepted socket: without it a response's header and body
    writes wait for the client's delayed ACK, 40 ms a request on a kept-alive connection
    (make bench-gateway measured it)."""
    async with gateway.http() as client:
        assert (await client.get("/v1/models")).status_code == 200
        (connection,) = gateway.listener.server.server_state.connections
        sock = connection.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
