"""The gateway as `aimesh serve gateway`, in front of the real LLM mesh (tokenizer,
prefill, two decode replicas, generation) and the real embedder, each its own process,
driven by the openai SDK and raw httpx over loopback."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from aimesh.llm.v1 import decode_pb2, decode_pb2_grpc, generation_pb2
from aimesh.retrieval.v1 import embedder_pb2, embedder_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings
from services.llm.artifacts import DEFAULT_NAME, resolve_model
from tests.conftest import free_port
from tests.services.gateway.conftest import KEY, KEYS, write_keys
from tests.services.llm.conftest import LlmMesh, collected, running_llm_mesh

pytestmark = pytest.mark.system

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class LlmGateway:
    def __init__(self, mesh: LlmMesh, http_port: int, embedder_port: int) -> None:
        self.mesh = mesh
        self.url = f"http://127.0.0.1:{http_port}"
        self.embedder = f"127.0.0.1:{embedder_port}"

    def sdk(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"authorization": f"Bearer {KEY}"}, timeout=120
        )


@pytest.fixture(scope="module")
def llm_gateway(tmp_path_factory) -> Iterator[LlmGateway]:
    """One LLM mesh, one embedder and one gateway for the module; every process is
    stopped by running_llm_mesh's own teardown, whatever happens here."""
    resolve_model(None, MeshSettings().cache_dir)  # converted once, before five processes race
    root = tmp_path_factory.mktemp("llm-gateway")
    keys = root / "keys.json"
    write_keys(keys, KEYS)
    with running_llm_mesh(root) as mesh:
        http_port, embedder_port, gateway_port = free_port(), free_port(), free_port()
        shared = {"AIMESH_SERVICES__EMBEDDER__PORT": str(embedder_port)}
        mesh.processes.start_all(
            [
                ("embedder", "embedder", embedder_port,
                 {**shared, "AIMESH_SERVICES__EMBEDDER__METRICS_PORT": "0"}),
                ("gateway", "gateway", gateway_port, {
                    **shared,
                    "AIMESH_SERVICES__GATEWAY__METRICS_PORT": "0",
                    "AIMESH_SERVICES__GATEWAY__HTTP_PORT": str(http_port),
                    "AIMESH_SERVICES__GATEWAY__API_KEYS_FILE": str(keys),
                }),
            ]
        )  # fmt: skip
        yield LlmGateway(mesh, http_port, embedder_port)


async def _running(gateway: LlmGateway) -> int:
    running = 0
    for port in gateway.mesh.decode_ports:
        async with create_channel(f"127.0.0.1:{port}", MeshSettings()) as channel:
            load = await decode_pb2_grpc.DecodeServiceStub(channel).GetLoad(
                decode_pb2.GetLoadRequest(), timeout=5
            )
            running += load.running
    return running


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}])
async def test_streamed_text_equals_whole_text(llm_gateway, sampling):
    async with llm_gateway.sdk() as client:
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
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens <= 24


async def test_raw_events_end_with_one_finish_the_usage_and_done(llm_gateway):
    body = {
        "model": DEFAULT_NAME,
        "messages": QUESTION,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        llm_gateway.http() as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        raw = b"".join([part async for part in response.aiter_raw()]).decode()
    assert raw.endswith("\n\ndata: [DONE]\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n")[:-2]]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert sum(1 for c in chunks[:-1] if c["choices"][0]["finish_reason"]) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_a_completion_is_what_the_generation_service_answers(llm_gateway):
    prompt = "The capital of France is"
    async with llm_gateway.sdk() as client:
        answer = await client.completions.create(
            model=DEFAULT_NAME, prompt=prompt, max_tokens=8, temperature=0
        )
    stub, channel = llm_gateway.mesh.stub()
    async with channel:
        _, text, complete = await collected(
            stub.Generate(
                generation_pb2.GenerateRequest(
                    prompt=prompt, stopping={"max_new_tokens": 8}, sampling={"temperature": 0}
                ),
                timeout=120,
            )
        )
    assert answer.choices[0].text == text
    assert answer.usage.prompt_tokens == complete.usage.prompt_tokens


async def test_the_routers_refusal_names_the_openai_parameter(llm_gateway):
    async with llm_gateway.sdk() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=DEFAULT_NAME, messages=QUESTION, max_completion_tokens=100_000
            )
    assert refused.value.body["param"] == "max_completion_tokens"


async def test_embeddings_equal_the_embedders_vectors(llm_gateway):
    texts = ["How do I copy a nested list?", "naïve café 🙂", "gRPC"]
    async with llm_gateway.sdk() as client:
        answer = await client.embeddings.create(model=EMBEDDING_MODEL, input=texts)
    async with create_channel(llm_gateway.embedder, MeshSettings()) as channel:
        direct = await embedder_pb2_grpc.EmbedderServiceStub(channel).Embed(
            embedder_pb2.EmbedRequest(inputs=texts), timeout=30
        )
    expected = np.array([e.values for e in direct.embeddings], dtype=np.float32)
    got = np.array([d.embedding for d in answer.data], dtype=np.float32)
    np.testing.assert_array_equal(got, expected)
    assert answer.model == direct.model == EMBEDDING_MODEL


async def test_a_client_that_disconnects_frees_its_decode_slot(llm_gateway):
    body = {
        "model": DEFAULT_NAME,
        "messages": [{"role": "user", "content": "Count slowly from one to five hundred."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    async with llm_gateway.http() as client:
        response = await client.send(
            client.build_request("POST", "/v1/chat/completions", json=body), stream=True
        )
        events = (line async for line in response.aiter_lines() if line)
        for _ in range(3):  # the role event, then text: decode is under way
            assert (await anext(events)).startswith("data: ")
        assert await _running(llm_gateway) == 1
        await response.aclose()
    started = time.monotonic()
    while await _running(llm_gateway):
        assert time.monotonic() - started < 2.0, "decode slot still busy 2 s after disconnect"
        await asyncio.sleep(0.02)
