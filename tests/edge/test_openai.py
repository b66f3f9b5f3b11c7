"""Conformance of the OpenAI API as users meet it: the real `openai` SDK and raw httpx
against `aimesh up --edge` (Envoy in front of the gateway, the real LLM mesh, embedder,
rerank and digits diffusion), in the spirit of vLLM's and llama.cpp's server tests. Each
answer is compared with the mesh service's own answer over gRPC."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import httpx
import numpy as np
import openai
import pydantic
import pytest
from PIL import Image

from aimesh.llm.v1 import decode_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc
from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings
from services.llm.artifacts import DEFAULT_NAME
from services.llm.passes import cut_at_or_before
from tests.conftest import eventually
from tests.edge.conftest import LIMIT_WINDOW_S, Edge
from tests.services.llm.conftest import collected

pytestmark = pytest.mark.system

KEY = "sk-everything"
EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def sdk(edge: Edge, key: str = KEY, max_retries: int = 0) -> openai.AsyncOpenAI:
    """The SDK as a user configures it: base_url and api_key, nothing else."""
    return openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=key, max_retries=max_retries)


def http(edge: Edge, key: str | None = KEY) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=edge.url, headers=headers, timeout=120)


def local(edge: Edge, service: str):
    """A mesh channel straight to `service`, around Envoy and the gateway."""
    return create_channel(f"127.0.0.1:{edge.ports[service]}", MeshSettings())


async def _running(edge: Edge) -> int:
    async with local(edge, "decode") as channel:
        load = await decode_pb2_grpc.DecodeServiceStub(channel).GetLoad(
            decode_pb2.GetLoadRequest(), timeout=5
        )
    return load.running


async def test_models_lists_every_surface(edge):
    """Diffusion's and rerank's models appear once those services answer, which may be
    after the gateway is ready (it waits for generation and the embedder only)."""
    expected = {DEFAULT_NAME, EMBEDDING_MODEL, "digits", "minilm-late-interaction"}
    async with sdk(edge) as client:

        async def listed() -> bool:
            return expected <= {model.id for model in (await client.models.list()).data}

        await eventually(listed, timeout_s=120, interval_s=0.5)
        one = await client.models.retrieve(DEFAULT_NAME)
    assert one.id == DEFAULT_NAME


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}])
async def test_streamed_text_equals_whole_text(edge, sampling):
    async with sdk(edge) as client:
        whole = await client.chat.completions.create(
            model=DEFAULT_NAME, messages=QUESTION, max_tokens=24, **sampling
        )
        stream = await client.chat.completions.create(
            model=DEFAULT_NAME,
            messages=QUESTION,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [r for r in reasons if r] == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
        whole.usage.total_tokens,
    )
    assert whole.usage.completion_tokens <= 24
    # The same prompt again: prefill's prefix cache held all of it but the last token, and
    # prefill used it up to its last fixed cut (services/llm/passes.py).
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached == cut_at_or_before(usage.prompt_tokens - 1)


async def test_n_seeded_choices_are_distinct_and_stream_each_under_its_index(edge):
    """n=3 with a seed: three different samples (choice i draws with seed + i), each the
    same streamed as whole, every streamed chunk under its own index."""
    sampling = {"n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 12}
    async with sdk(edge) as client:
        whole = await client.chat.completions.create(
            model=DEFAULT_NAME, messages=QUESTION, **sampling
        )
        stream = await client.chat.completions.create(
            model=DEFAULT_NAME, messages=QUESTION, stream=True, **sampling
        )
        streamed: dict[int, str] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + (
                    choice.delta.content or ""
                )
    texts = [choice.message.content for choice in whole.choices]
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    assert len(set(texts)) == 3
    assert streamed == dict(enumerate(texts))


async def test_logprobs_make_the_text_and_match_the_generation_services(edge):
    """Chat logprobs through Envoy: the tokens' bytes are the answer, each token is among
    its own top alternatives, and the figures are the generation service's over gRPC."""
    async with sdk(edge) as client:
        answer = await client.chat.completions.create(
            model=DEFAULT_NAME,
            messages=QUESTION,
            temperature=0,
            max_tokens=10,
            logprobs=True,
            top_logprobs=3,
        )
        completion = await client.completions.create(
            model=DEFAULT_NAME, prompt="The capital of France is", max_tokens=6, logprobs=2
        )
    content = answer.choices[0].logprobs.content
    assert bytes(b for entry in content for b in entry.bytes).decode() == (
        answer.choices[0].message.content
    )
    assert all(e.top_logprobs[0].token == e.token and len(e.top_logprobs) == 3 for e in content)
    assert all(e.logprob <= 0 for e in content)
    legacy = completion.choices[0].logprobs
    assert "".join(legacy.tokens) == completion.choices[0].text
    assert len(legacy.top_logprobs) == len(legacy.tokens)
    request = generation_pb2.ChatRequest(messages=QUESTION)
    request.sampling.logprobs, request.sampling.top_logprobs = True, 3
    request.stopping.max_new_tokens = 10
    async with local(edge, "generation") as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).Chat(request, timeout=120)
        direct = [e async for m in call if m.HasField("chunk") for e in m.chunk.logprobs]
    assert [e.token for e in content] == [e.token for e in direct]
    # The second call finds the prompt in the prefix cache: the same within float error.
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in direct], abs=1e-3)


async def test_raw_events_through_envoy_end_with_one_finish_the_usage_and_done(edge):
    body = {
        "model": DEFAULT_NAME,
        "messages": QUESTION,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        http(edge) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        parts = [part async for part in response.aiter_raw()]
    raw = b"".join(parts).decode()
    assert len(parts) > 1, "the events arrived in one piece: something buffered them"
    assert raw.endswith("\n\ndata: [DONE]\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n")[:-2]]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert sum(1 for c in chunks[:-1] if c["choices"][0]["finish_reason"]) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_without_include_usage_no_usage_chunk(edge):
    async with sdk(edge) as client:
        stream = await client.chat.completions.create(
            model=DEFAULT_NAME, messages=QUESTION, max_tokens=4, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert all(c.choices and c.usage is None for c in chunks)


async def test_a_completion_is_what_the_generation_service_answers(edge):
    prompt = "The capital of France is"
    async with sdk(edge) as client:
        answer = await client.completions.create(
            model=DEFAULT_NAME, prompt=prompt, max_tokens=8, temperature=0
        )
    async with local(edge, "generation") as channel:
        _, text, complete = await collected(
            generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                generation_pb2.GenerateRequest(
                    prompt=prompt, stopping={"max_new_tokens": 8}, sampling={"temperature": 0}
                ),
                timeout=120,
            )
        )
    assert answer.choices[0].text == text
    assert answer.usage.prompt_tokens == complete.usage.prompt_tokens


async def test_bad_values_are_400s_that_name_the_parameter(edge):
    async with sdk(edge) as client:
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.chat.completions.create(
                model=DEFAULT_NAME, messages=QUESTION, max_completion_tokens=100_000
            )
        with pytest.raises(openai.BadRequestError) as too_hot:
            await client.chat.completions.create(
                model=DEFAULT_NAME, messages=QUESTION, temperature=7
            )
        with pytest.raises(openai.BadRequestError) as tools:
            await client.chat.completions.create(
                model=DEFAULT_NAME,
                messages=QUESTION,
                tools=[{"type": "function", "function": {"name": "f", "parameters": []}}],
            )
        with pytest.raises(openai.BadRequestError) as bad_schema:
            await client.chat.completions.create(
                model=DEFAULT_NAME,
                messages=QUESTION,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
            )
    assert too_long.value.body["param"] == "max_completion_tokens"
    assert too_hot.value.body["param"] == "temperature"
    assert tools.value.body["param"] == "tools[0].function.parameters"
    assert bad_schema.value.body["param"] == "tools"


class Capital(pydantic.BaseModel):
    """Every length bounded: a 135M model, greedy, may write digits until max_tokens."""

    country: str = pydantic.Field(max_length=40)
    capital: str = pydantic.Field(max_length=40)
    population_millions: int = pydantic.Field(ge=0, le=10_000)


async def test_structured_output_parses_into_a_pydantic_model(edge):
    """The SDK's own structured-output flows, unmodified: `parse` sends the model's strict
    JSON schema and parses the answer back into the model; `stream` parses the deltas as
    they come and the final message the same way; json_object gives an object."""
    async with sdk(edge) as client:
        parsed = await client.chat.completions.parse(
            model=DEFAULT_NAME, messages=QUESTION, response_format=Capital, max_tokens=80
        )
        async with client.chat.completions.stream(
            model=DEFAULT_NAME,
            messages=QUESTION,
            response_format=Capital,
            max_tokens=80,
            temperature=0.7,
            seed=5,
        ) as stream:
            deltas = [event.delta async for event in stream if event.type == "content.delta"]
            streamed = await stream.get_final_completion()
        free_form = await client.chat.completions.create(
            model=DEFAULT_NAME,
            messages=[{"role": "user", "content": "Paris's name and country, in JSON."}],
            max_tokens=200,
            response_format={"type": "json_object"},
            # Greedy, and a short answer asked for: at OpenAI's default temperature of 1,
            # or asked to describe, this model may ramble past max_tokens.
            temperature=0,
        )
        with pytest.raises(openai.BadRequestError) as bad_schema:
            await client.chat.completions.create(
                model=DEFAULT_NAME,
                messages=QUESTION,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "nonsense"}},
                },
            )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Capital)
    final = streamed.choices[0].message
    assert len(deltas) > 1 and "".join(deltas) == final.content
    assert isinstance(final.parsed, Capital)
    assert free_form.choices[0].finish_reason == "stop", free_form.choices[0].message.content
    assert isinstance(json.loads(free_form.choices[0].message.content), dict)
    assert bad_schema.value.body["param"] == "response_format.json_schema.schema"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# A required call of the weather tool, one (parallel_tool_calls off).
ONE_WEATHER_CALL = {
    "model": DEFAULT_NAME,
    "messages": WEATHER_QUESTION,
    "tools": [WEATHER_TOOL],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "max_tokens": 60,
}


async def test_the_sdk_round_trips_a_tool_call_whole_and_streamed(edge):
    """The SDK's tool flow: a required call (one: parallel_tool_calls off), whole and
    streamed (the deltas rebuilt as the SDK's docs do), the same greedy call both ways;
    then the result sent back in the history, and the turn after it well formed."""
    call_it = {**ONE_WEATHER_CALL, "temperature": 0}
    async with sdk(edge) as client:
        whole = await client.chat.completions.create(**call_it)
        stream = await client.chat.completions.create(**call_it, stream=True)
        rebuilt: dict[int, dict] = {}
        reasons = []
        async for chunk in stream:
            reasons.append(chunk.choices[0].finish_reason)
            for delta in chunk.choices[0].delta.tool_calls or []:
                call = rebuilt.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        choice = whole.choices[0]
        (call,) = choice.message.tool_calls
        answer = await client.chat.completions.create(
            model=DEFAULT_NAME,
            messages=[
                *WEATHER_QUESTION,
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
            ],
            tools=[WEATHER_TOOL],
            temperature=0,
            max_tokens=80,
        )
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert rebuilt == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert [r for r in reasons if r] == ["tool_calls"]
    after = answer.choices[0]
    assert after.finish_reason in ("stop", "tool_calls")
    assert (
        (after.message.content or "") if after.finish_reason == "stop" else after.message.tool_calls
    )


async def test_each_of_n_choices_calls_its_tool_in_its_own_deltas(edge):
    """n = 3 sampled choices of one required call: each choice's streamed deltas rebuild
    its own call (the router takes each choice's output apart on its own), equal to the
    call the whole response gives that choice under the same seed."""
    call_it = {**ONE_WEATHER_CALL, "temperature": 1.0, "seed": 11, "n": 3}
    async with sdk(edge) as client:
        whole = await client.chat.completions.create(**call_it)
        stream = await client.chat.completions.create(**call_it, stream=True)
        rebuilt: dict[int, dict] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    assert delta.index == 0  # one call a choice
                    call = rebuilt.setdefault(choice.index, {"name": "", "arguments": ""})
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    calls = {}
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        json.loads(call.function.arguments)
        calls[choice.index] = {"name": "get_weather", "arguments": call.function.arguments}
    assert rebuilt == calls


async def test_langchain_binds_tools_and_structures_output_unmodified(edge):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "Sunny"

    llm = ChatOpenAI(
        base_url=f"{edge.url}/v1", api_key=KEY, model=DEFAULT_NAME, temperature=0, max_tokens=80
    )
    message = await llm.bind_tools([get_weather], tool_choice="get_weather").ainvoke(
        "What is the weather in Paris?"
    )
    capital = await llm.with_structured_output(Capital).ainvoke("What is the capital of France?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert isinstance(capital, Capital)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
async def test_the_openai_agents_sdk_runs_a_function_tool_and_an_output_type(edge, api):
    """On either of the SDK's model APIs: Chat Completions, or the Responses API (its
    default)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return "Sunny, 24 C"

    async with sdk(edge) as client:
        kind = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
        model = kind(model=DEFAULT_NAME, openai_client=client)
        settings = ModelSettings(temperature=0, max_tokens=80)
        weather = Agent(
            name="weather",
            instructions="Use the tool to answer.",
            tools=[get_weather],
            model=model,
            model_settings=ModelSettings(
                temperature=0, max_tokens=80, tool_choice="required", parallel_tool_calls=False
            ),
            tool_use_behavior="stop_on_first_tool",
        )
        facts = Agent(name="facts", model=model, model_settings=settings, output_type=Capital)
        called = await Runner.run(weather, "What is the weather in Paris?", max_turns=3)
        structured = await Runner.run(facts, "What is the capital of France?", max_turns=1)
        streamed = Runner.run_streamed(facts, "What is the capital of France?", max_turns=1)
        async for _ in streamed.stream_events():
            pass
    assert called.final_output == "Sunny, 24 C" and len(asked) == 1
    assert isinstance(structured.final_output, Capital)
    assert isinstance(streamed.final_output, Capital)


async def test_the_responses_api_answers_and_parses_structured_output(edge):
    async with sdk(edge) as client:
        answer = await client.responses.create(
            model=DEFAULT_NAME, input="What is the capital of France?", max_output_tokens=24
        )
        parsed = await client.responses.parse(
            model=DEFAULT_NAME,
            input="What is the capital of France?",
            text_format=Capital,
            max_output_tokens=80,
        )
    assert answer.output_text and answer.usage.output_tokens <= 24
    assert isinstance(parsed.output_parsed, Capital)


async def test_keys_scopes_and_models_are_401_403_404(edge):
    async with sdk(edge, key="sk-nobody") as nobody, sdk(edge, key="sk-embed-only") as embedder:
        with pytest.raises(openai.AuthenticationError):
            await nobody.models.list()
        with pytest.raises(openai.PermissionDeniedError) as forbidden:
            await embedder.chat.completions.create(model=DEFAULT_NAME, messages=QUESTION)
    async with sdk(edge) as client:
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert forbidden.value.body["code"] == "missing_scope"
    assert unknown.value.body["param"] == "model"


async def test_past_a_tiny_quota_429_with_retry_after_which_the_sdk_honours(edge):
    """The tenant "tiny" may send one request per LIMIT_WINDOW_S."""
    body = {"model": EMBEDDING_MODEL, "input": "hello"}
    async with http(edge, "sk-tiny") as client:
        for _ in range(5):  # the bucket starts full: empty it
            refused = await client.post("/v1/embeddings", json=body)
            if refused.status_code == 429:
                break
    refused_at = time.monotonic()
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "rate_limit_error"
    wait_s = int(refused.headers["retry-after-ms"]) / 1000
    assert 0 < wait_s <= LIMIT_WINDOW_S
    assert int(refused.headers["retry-after"]) >= 1
    async with sdk(edge, "sk-tiny", max_retries=3) as patient:
        await patient.embeddings.create(model=EMBEDDING_MODEL, input="waits its turn")
    # Served once the bucket had room again, and not before: the SDK waited as told.
    assert time.monotonic() - refused_at >= wait_s - 0.05


async def test_embeddings_equal_the_embedders_vectors(edge):
    texts = ["How do I copy a nested list?", "naïve café 🙂", "gRPC"]
    async with sdk(edge) as client:
        answer = await client.embeddings.create(model=EMBEDDING_MODEL, input=texts)
        encoded = await client.embeddings.create(
            model=EMBEDDING_MODEL, input=texts, encoding_format="base64"
        )
    async with local(edge, "embedder") as channel:
        direct = await embedder_pb2_grpc.EmbedderServiceStub(channel).Embed(
            embedder_pb2.EmbedRequest(inputs=texts), timeout=30
        )
    expected = np.array([e.values for e in direct.embeddings], dtype=np.float32)
    np.testing.assert_array_equal(
        np.array([d.embedding for d in answer.data], np.float32), expected
    )
    # Asked for explicitly, base64 comes back as the string (the SDK decodes it only
    # when it chose the encoding itself): little-endian float32.
    decoded = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in encoded.data]
    np.testing.assert_array_equal(np.stack(decoded), expected)
    assert answer.model == direct.model == EMBEDDING_MODEL


async def test_rerank_in_coheres_shape_matches_the_rerank_service(edge):
    query = "how do I remove a folder and its contents?"
    documents = [
        "heapq.heappush(heap, item): push item onto the heap.",
        "shutil.rmtree(path): recursively delete a directory tree.",
        "json.loads(s): deserialize a str containing a JSON document.",
    ]
    async with http(edge) as client:
        answer = await client.post(
            "/v1/rerank",
            json={"model": "minilm-late-interaction", "query": query, "documents": documents},
        )
    assert answer.status_code == 200, answer.text
    async with local(edge, "rerank") as channel:
        direct = await rerank_pb2_grpc.RerankServiceStub(channel).Rerank(
            rerank_pb2.RerankRequest(
                query=query, documents=[rerank_pb2.Document(text=d) for d in documents]
            ),
            timeout=30,
        )
    results = answer.json()["results"]
    assert [r["index"] for r in results] == [r.index for r in direct.results]
    assert results[0]["document"]["text"] == documents[1]
    assert answer.json()["usage"]["total_tokens"] == direct.usage.prompt_tokens > 0


async def test_images_decode_as_pngs(edge):
    async with sdk(edge) as client:
        answer = await client.images.generate(
            model="digits", prompt="3", n=2, extra_body={"seed": 5, "steps": 10}
        )
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in answer.data]
    assert [(image.format, image.size) for image in images] == [("PNG", (8, 8))] * 2


async def test_a_client_that_disconnects_frees_its_decode_slot(edge):
    body = {
        "model": DEFAULT_NAME,
        "messages": [{"role": "user", "content": "Count slowly from one to five hundred."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    async with http(edge) as client:
        response = await client.send(
            client.build_request("POST", "/v1/chat/completions", json=body), stream=True
        )
        events = (line async for line in response.aiter_lines() if line)
        for _ in range(3):  # the role event, then text: decode is under way
            assert (await anext(events)).startswith("data: ")
        assert await _running(edge) == 1
        await response.aclose()
    started = time.monotonic()
    while await _running(edge):
        assert time.monotonic() - started < 2.0, "decode slot still busy 2 s after disconnect"
        await asyncio.sleep(0.02)
