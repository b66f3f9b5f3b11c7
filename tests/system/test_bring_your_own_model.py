"""Bring your own model: a GGUF alone, of each test architecture (tiny random weights made
with transformers and converted by llama.cpp's own converter, tests/gguf_models.py), served
by `aimesh up --model X.gguf --edge` - tokenizer, llama.cpp prefill and decode, the router,
the gateway and Envoy as processes - and checked against llama.cpp itself in this process:

- greedy tokens through tokenizer -> prefill -> KV handoff -> decode -> router equal
  llama.cpp's own greedy tokens for the same prompt, token for token;
- the chat prompt the mesh renders equals transformers' apply_chat_template of the model's
  Hugging Face directory (each architecture has its family's template);
- a stop string cuts the text where it first appears, a character whose bytes span several
  tokens comes out whole, and a request past the model's context (read from the GGUF) is
  refused naming the field;
- chat and completions answer through the edge's gRPC and the OpenAI gateway behind it;
- tool calls come back through the SDK, in the template's own format where it knows tools
  (Qwen's) and in the generic one elsewhere.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import llama_cpp
import openai
import pytest
from transformers import AutoTokenizer

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh.config import MeshSettings
from mesh.edge.process import wait_ready
from mesh.errors import field_violations
from mesh.info import get_info
from services.llm import llama_backend
from tests.conftest import free_port, start_mesh, stop_mesh, subprocess_env, wait_all_serving
from tests.gguf_models import ARCHITECTURES, TinyModel, tiny_gguf
from tests.services.gateway.conftest import write_keys
from tests.services.llm.conftest import collected

pytestmark = pytest.mark.system

SERVICES = ("generation", "tokenizer", "prefill", "decode", "embedder", "gateway")
KEY = "sk-byom"
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPT = "The capital of France is Paris, and the capital of Japan is"
NEW_TOKENS = 24
# No system turn: Mistral's template refuses one (each family's own rule).
CONVERSATION = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "Grüße! What is 2 + 2? 🤖"},
]
# Bytes of one character that the byte-level vocabulary splits over several tokens.
SPLIT_CHARACTER = "🤖👍🏽"


@dataclass
class Mesh:
    model: TinyModel
    ports: dict[str, int]
    edge_port: int

    def local(self, service: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"127.0.0.1:{self.ports[service]}")

    def generation(self, channel: grpc.aio.Channel) -> generation_pb2_grpc.GenerationServiceStub:
        return generation_pb2_grpc.GenerationServiceStub(channel)


@asynccontextmanager
async def byom_mesh(model: TinyModel, logs: Path) -> AsyncIterator[Mesh]:
    """`aimesh up --model <gguf> --edge` with the LLM, the embedder the gateway needs to be
    ready, the gateway and Envoy; stopped (its process group killed if need be) at the end."""
    ports = {name: free_port() for name in SERVICES}
    mesh = Mesh(model, ports, free_port())
    admin_port = free_port()
    keys = logs / "keys.json"
    write_keys(keys, {KEY: ("byom", ["generate", "embed", "read"])})
    env = subprocess_env(
        OTEL_TRACES_EXPORTER="none",
        AIMESH_EDGE__PORT=str(mesh.edge_port),
        AIMESH_EDGE__ADMIN_PORT=str(admin_port),
        AIMESH_EDGE__AUTHORIZER_PORT=str(free_port()),
        AIMESH_EDGE__METRICS_PORT=str(free_port()),
        AIMESH_EDGE__API_KEYS_FILE=str(keys),
        AIMESH_LIMITS__TENANTS_FILE=str(keys),
        AIMESH_LIMITS__STORE=f"sqlite:{logs / 'limits.sqlite'}",
        AIMESH_SERVICES__GATEWAY__API_KEYS_FILE=str(keys),
        AIMESH_SERVICES__GATEWAY__HTTP_PORT=str(free_port()),
        AIMESH_ENGINES__LLM__MAX_BATCH_SIZE="4",
        **{f"AIMESH_SERVICES__{name.upper()}__PORT": str(port) for name, port in ports.items()},
        **{f"AIMESH_SERVICES__{name.upper()}__METRICS_PORT": "0" for name in SERVICES},
    )
    only = [arg for name in SERVICES for arg in ("--only", name)]
    process = await start_mesh(
        *only, "--edge", "--model", str(model.gguf), "--log-dir", str(logs), env=env
    )
    try:
        await wait_all_serving(ports)
        if not await wait_ready(process, admin_port, timeout_s=60):
            raise AssertionError("envoy did not become ready")
        yield mesh
    finally:
        await stop_mesh(process)


def llama_cpp_greedy(gguf: Path, prompt: str, count: int) -> tuple[list[int], list[int]]:
    """The prompt's ids and `count` greedy tokens as llama.cpp itself makes them, in one
    process and one context (no KV handoff, no mesh), on the CPU kernels the engine loads."""
    llama_backend.start()
    # Flash attention on: llama.cpp's own default on a CPU (auto), which llama-server and
    # the engine's contexts use; the Python wrapper's default turns it off, and attention
    # summed the other way flips near-tied argmaxes of a random-weight model.
    model = llama_cpp.Llama(str(gguf), n_ctx=512, n_threads=1, verbose=False, flash_attn=True)
    try:
        prompt_ids = model.tokenize(prompt.encode(), add_bos=True, special=False)
        generated = []
        for token in model.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            generated.append(token)
            if len(generated) == count:
                break
        return prompt_ids, generated
    finally:
        model.close()


def greedy(prompt: str, count: int, **stopping: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=prompt,
        sampling=sampling_pb2.SamplingParameters(temperature=0),
        stopping=sampling_pb2.StoppingCriteria(
            **{"ignore_eos": True, **stopping}, max_new_tokens=count
        ),
    )


async def check_generation(mesh: Mesh) -> None:
    prompt_ids, expected = await asyncio.to_thread(
        llama_cpp_greedy, mesh.model.gguf, PROMPT, NEW_TOKENS
    )
    async with mesh.local("generation") as channel:
        ids, text, complete = await collected(
            mesh.generation(channel).Generate(greedy(PROMPT, NEW_TOKENS), timeout=120)
        )
        assert complete.usage.prompt_tokens == len(prompt_ids)
        assert ids == expected

        # A stop string: the text before its first appearance, nothing after.
        stop = text[len(text) // 3 : len(text) // 3 + 4]
        if stop.strip():
            _, stopped, _ = await collected(
                mesh.generation(channel).Generate(
                    greedy(PROMPT, NEW_TOKENS, stop_sequences=[stop]), timeout=120
                )
            )
            assert stopped == text[: text.index(stop)]

        # Guided choice forces characters whose bytes span several tokens: they come out
        # whole, never as U+FFFD halves.
        choice = greedy(PROMPT, 32, ignore_eos=False)
        choice.sampling.choices.append(SPLIT_CHARACTER)
        _, chosen, _ = await collected(mesh.generation(channel).Generate(choice, timeout=120))
        assert chosen == SPLIT_CHARACTER

        # The context is the GGUF's: a prompt past it is refused, naming the field.
        info = await get_info(f"127.0.0.1:{mesh.ports['generation']}")
        limits = info.models[0].limits
        assert limits["max_seq_len"] == limits["context_length"] == "512"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collected(mesh.generation(channel).Generate(greedy(PROMPT, 510), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_new_tokens" in refused.value.details()


async def check_chat_template(mesh: Mesh) -> None:
    reference = AutoTokenizer.from_pretrained(mesh.model.hf_dir).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    async with mesh.local("tokenizer") as channel:
        rendered = await tokenizer_pb2_grpc.TokenizerServiceStub(channel).ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(
                messages=turns_of(CONVERSATION),
                add_generation_prompt=True,
            ),
            timeout=60,
        )
    assert rendered.text == reference
    if "system" in rendered.roles:
        return
    # A turn only the template refuses (Mistral's: no system turn) is the caller's error.
    refused = [common_pb2.ChatMessage(role="system", content="Be brief."), *turns_of(CONVERSATION)]
    async with mesh.local("generation") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collected(
                mesh.generation(channel).Chat(
                    generation_pb2.ChatRequest(messages=refused), timeout=60
                )
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].role" in {v.field for v in field_violations(caught.value)}


def turns_of(conversation: list[dict[str, str]]) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(**turn) for turn in conversation]


async def check_edge_and_gateway(mesh: Mesh) -> None:
    """Chat and completions through Envoy: gRPC with the key, and the OpenAI SDK."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mesh.edge_port}") as channel:
        stub = mesh.generation(channel)
        ids, _, _ = await collected(stub.Generate(greedy(PROMPT, 4), metadata=AUTH, timeout=120))
        assert len(ids) == 4
        chat = generation_pb2.ChatRequest(
            messages=turns_of(CONVERSATION),
            stopping=sampling_pb2.StoppingCriteria(max_new_tokens=4, ignore_eos=True),
        )
        ids, _, _ = await collected(stub.Chat(chat, metadata=AUTH, timeout=120))
        assert len(ids) == 4
    name = mesh.model.gguf.stem
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{mesh.edge_port}/v1", api_key=KEY, max_retries=0
    ) as client:
        cards = {card.id: card.model_extra for card in (await client.models.list()).data}
        assert cards[name]["max_model_len"] == 512
        assert cards[name]["meta"]["architecture"] == mesh.model.architecture
        reply = await client.chat.completions.create(
            model=name, messages=CONVERSATION, max_tokens=4, temperature=0
        )
        assert reply.usage.completion_tokens == 4 or reply.choices[0].finish_reason == "stop"
        completion = await client.completions.create(
            model=name, prompt=PROMPT, max_tokens=4, temperature=0
        )
        assert completion.choices[0].text or completion.choices[0].finish_reason == "stop"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                # Choices: a random model's free string may run on in bytes.
                "city": {"enum": ["Oslo", "Paris"]},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


# The tool format of each family's template here; the others know no tools.
NATIVE_TOOL_FORMATS = {
    "qwen3": tokenizer_pb2.TOOL_FORMAT_HERMES,
    "llama": tokenizer_pb2.TOOL_FORMAT_LLAMA3,
}


async def check_tools(mesh: Mesh) -> None:
    """A template that knows tools (Qwen's format, Llama 3.1's) renders them itself, and
    the model's calls come back whole and streamed as OpenAI's; one that does not keeps
    the generic format. Either way, a call and its result in the history render and
    answer."""
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    async with mesh.local("tokenizer") as channel:
        rendered = await tokenizer_pb2_grpc.TokenizerServiceStub(channel).ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(
                messages=turns_of(question),
                add_generation_prompt=True,
                tools=json.dumps([WEATHER_TOOL]),
            ),
            timeout=60,
        )
    expected = NATIVE_TOOL_FORMATS.get(mesh.model.architecture, 0)
    assert rendered.tool_format == expected
    if expected:
        reference = AutoTokenizer.from_pretrained(mesh.model.hf_dir).apply_chat_template(
            question, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
        )
        assert rendered.text == reference and '"get_weather"' in reference
    call_it = {
        "model": mesh.model.gguf.stem,
        "messages": question,
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "temperature": 0,
        # Room for the call in the generic envelope (~90 characters) in a vocabulary
        # of mostly single characters (the SentencePiece test models').
        "max_tokens": 200,
    }
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{mesh.edge_port}/v1", api_key=KEY, max_retries=0
    ) as client:
        whole = await client.chat.completions.create(**call_it)
        rebuilt: dict[int, dict] = {}
        async for chunk in await client.chat.completions.create(**call_it, stream=True):
            deltas = chunk.choices[0].delta.tool_calls if chunk.choices else None
            for delta in deltas or []:
                call = rebuilt.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert {call.function.name for call in calls} == {"get_weather"}
        for call in calls:
            assert json.loads(call.function.arguments)["unit"] in ("C", "F")
        assert rebuilt == {
            i: {"name": c.function.name, "arguments": c.function.arguments}
            for i, c in enumerate(calls)
        }
        answer = await client.chat.completions.create(
            model=mesh.model.gguf.stem,
            messages=[
                *question,
                choice.message.model_dump(exclude_none=True),
                *(
                    {"role": "tool", "tool_call_id": call.id, "content": "Rain, 4 C"}
                    for call in calls
                ),
            ],
            tools=[WEATHER_TOOL],
            tool_choice="none",
            max_tokens=4,
            temperature=0,
        )
        assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
async def test_a_gguf_alone_serves_through_the_whole_mesh(architecture, tmp_path):
    model = await asyncio.to_thread(
        tiny_gguf, architecture, MeshSettings().cache_dir / "test-models"
    )
    async with byom_mesh(model, tmp_path) as mesh:
        info = await get_info(f"127.0.0.1:{mesh.ports['decode']}")
        (described,) = info.models
        assert described.engine == "llama.cpp"
        assert described.limits["architecture"] == model.architecture
        assert described.limits["cpu_variant"]
        await check_generation(mesh)
        await check_chat_template(mesh)
        await check_edge_and_gateway(mesh)
        await check_tools(mesh)
