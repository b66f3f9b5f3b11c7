"""The LLM mesh with llama.cpp decode: tokenizer, prefill, two decode replicas and the
router as processes, with prefill on llama.cpp (its own state handed over) and on torch
(the default: its KV written as llama.cpp's state at decode), checked against the same
engines in this process (the GGUF's 4-bit model is not transformers' float32 one, so
transformers is no reference here). Structured output and tool calls run here too, the
model's own output through the router (the torch path of the mask: test_engine.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import jsonschema
import pytest
import torch

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import decode_pb2, generation_pb2, kv_cache_pb2, prefill_pb2, sampling_pb2
from mesh.artifacts import artifact_digest, sha256_of
from mesh.errors import error_info, field_violations
from mesh.info import get_info
from services.llm.artifacts import gguf_path, load_tokenizer
from services.llm.kv_codec import KvState
from services.llm.llama import Llama, LlamaConfig
from services.llm.llama_cpp import ENGINE_VERSION, LlamaCpp
from services.llm.passes import cut_at_or_before, passes
from tests.services.llm.conftest import (
    LlmMesh,
    decode_refusal,
    generate,
    metric_at,
    prefill_and_decode,
    running_llm_mesh,
    stopping,
)

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def llama_cpp_mesh(tmp_path_factory, model_dir) -> Iterator[LlmMesh]:
    root = tmp_path_factory.mktemp("llama-cpp-mesh")
    with running_llm_mesh(root, engine="llama.cpp", prefill_engine="llama.cpp") as mesh:
        yield mesh


@pytest.fixture(scope="module")
def mixed_mesh(tmp_path_factory, model_dir) -> Iterator[LlmMesh]:
    """The default on a CPU: torch prefill (float32 here, to compare across machines),
    llama.cpp decode."""
    root = tmp_path_factory.mktemp("mixed-mesh")
    with running_llm_mesh(root, engine="llama.cpp", prefill_engine="torch") as mesh:
        yield mesh


@pytest.fixture(scope="module")
def local(model_dir) -> Iterator[tuple[LlamaCpp, LlamaCpp]]:
    """llama.cpp in this process: a prefill context and a one-sequence decode context."""
    config = LlamaConfig.from_directory(model_dir)
    prefill = LlamaCpp(gguf_path(), config, sequences=1, max_seq_len=512, threads=1)
    decode = LlamaCpp(gguf_path(), config, sequences=1, max_seq_len=512, threads=1)
    yield prefill, decode
    prefill.close()
    decode.close()


def greedy_after(
    decode: LlamaCpp, prompt_ids: list[int], logits: torch.Tensor, kv: KvState, count: int
) -> list[int]:
    """Greedy tokens of one sequence whose prefill gave (logits, kv), decoded alone."""
    decode.load(0, kv)
    tokens = [int(logits.argmax())]
    while len(tokens) < count:
        position = len(prompt_ids) + len(tokens) - 1
        tokens.append(int(decode.decode([tokens[-1]], [position], [0])[0].argmax()))
    decode.free(0)
    return tokens


def greedy_alone(local: tuple[LlamaCpp, LlamaCpp], prompt_ids: list[int], count: int) -> list[int]:
    """Greedy tokens of one sequence, prefilled in prefill's fixed passes and handed to a
    decode context alone."""
    prefill, decode = local
    whole = prefill.prefill(prompt_ids, cuts=passes(0, len(prompt_ids)))
    return greedy_after(decode, prompt_ids, *whole, count)


async def still_decodes(decode, handle, prompt_ids: list[int], first_token_id: int) -> bool:
    """Whether `handle` decodes four tokens (after refusals of altered copies of it)."""
    call = decode.Decode(
        decode_pb2.DecodeRequest(
            kv_handle=handle,
            prompt_token_ids=prompt_ids,
            first_token_id=first_token_id,
            max_new_tokens=4,
            ignore_eos=True,
        ),
        timeout=30,
    )
    tokens = [t async for m in call if m.HasField("chunk") for t in m.chunk.token_ids]
    return len(tokens) == 4


async def test_prefill_and_decode_say_they_serve_the_gguf_on_llama_cpp(llama_cpp_mesh):
    models = {
        name: (await get_info(target, timeout_s=5)).models[0]
        for name, target in (
            ("prefill", llama_cpp_mesh.target("prefill")),
            ("decode", f"127.0.0.1:{llama_cpp_mesh.decode_ports[0]}"),
        )
    }
    for model in models.values():
        assert (model.engine, model.device) == ("llama.cpp", "cpu")
        assert model.sha256 == sha256_of(gguf_path())
        assert model.dtype == "Q4_1"


async def test_greedy_streams_in_one_batch_each_equal_llama_cpp_alone(
    llama_cpp_mesh, local, model_dir, prompts
):
    """Eight streams share decode's batches, joining and leaving at different steps; with
    a KV stream per sequence each output is bit for bit its sequence's alone."""
    tokenizer = load_tokenizer(model_dir)
    stub, channel = llama_cpp_mesh.stub()
    lengths = [24, 9, 17, 30, 5, 12, 20, 14]
    async with channel:
        runs = await asyncio.gather(
            *(
                generate(stub, prompt=prompt, stopping=stopping(n, ignore_eos=True))
                for prompt, n in zip(prompts, lengths, strict=False)
            )
        )
    for prompt, n, (ids, text, complete) in zip(prompts, lengths, runs, strict=False):
        assert ids == greedy_alone(local, tokenizer.encode(prompt).ids, n), prompt
        assert text == tokenizer.decode(ids)
        assert complete.finish_reason == sampling_pb2.FINISH_REASON_LENGTH


async def test_llama_cpp_logprobs_are_its_own_logits_log_softmax(llama_cpp_mesh, local, model_dir):
    """On the llama.cpp engine too, each token's logprob and alternatives come from the
    logits it computed (here recomputed by llama.cpp alone, one token at a time)."""
    tokenizer = load_tokenizer(model_dir)
    prompt = "The three primary colours are"
    sampling = sampling_pb2.SamplingParameters(logprobs=True, top_logprobs=2)
    stub, channel = llama_cpp_mesh.stub()
    async with channel:
        call = stub.Generate(
            generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling, stopping=stopping(6)),
            timeout=120,
        )
        chunks = [m.chunk async for m in call if m.HasField("chunk")]
    entries = [e for chunk in chunks for e in chunk.logprobs]
    assert b"".join(e.bytes for e in entries).decode() == "".join(c.text for c in chunks)
    prefill, decode = local
    prompt_ids = tokenizer.encode(prompt).ids
    logits, kv = prefill.prefill(prompt_ids)
    decode.load(0, kv)
    try:
        for step, entry in enumerate(entries):
            expected = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(expected, 2)
            assert [t.token_id for t in entry.top_logprobs] == top.indices.tolist()
            assert entry.logprob == pytest.approx(float(expected[entry.token_id]), abs=2e-3)
            position = len(prompt_ids) + step
            logits = decode.decode([entry.token_id], [position], [0])[0]
    finally:
        decode.free(0)


async def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(llama_cpp_mesh, prompts):
    stub, channel = llama_cpp_mesh.stub()
    sampled = sampling_pb2.SamplingParameters(temperature=0.9, top_p=0.95, top_k=50, seed=7)

    async def story() -> list[int]:
        ids, _, _ = await generate(
            stub, prompt="Tell me a story:", sampling=sampled, stopping=stopping(24)
        )
        return ids

    async with channel:
        alone = await story()
        crowd = [generate(stub, prompt=p, stopping=stopping(32)) for p in prompts[:6]]
        busy, *_ = await asyncio.gather(story(), *crowd)
    assert busy == alone


async def test_constrained_streams_on_llama_cpp_keep_their_form_beside_free_ones(
    llama_cpp_mesh, prompts
):
    """The constraint masks llama.cpp's logits as it masks torch's: each schema-bound
    stream is valid JSON, each seeded free stream the same as alone."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "sunny": {"type": "boolean"},
            "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
        },
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    constrained = [
        sampling_pb2.SamplingParameters(
            temperature=0.8,
            seed=seed,
            constraint=sampling_pb2.OutputConstraint(json_schema=json.dumps(schema)),
        )
        for seed in range(4)
    ]
    free = sampling_pb2.SamplingParameters(temperature=0.9, seed=3)
    stub, channel = llama_cpp_mesh.stub()
    async with channel:
        alone = [
            (await generate(stub, prompt=p, sampling=free, stopping=stopping(16)))[0]
            for p in prompts[:3]
        ]
        runs = await asyncio.gather(
            *(generate(stub, prompt=p, sampling=free, stopping=stopping(16)) for p in prompts[:3]),
            *(
                generate(stub, prompt="The weather as JSON:", sampling=s, stopping=stopping(100))
                for s in constrained
            ),
        )
    assert [ids for ids, _, _ in runs[:3]] == alone
    for _, text, complete in runs[3:]:
        assert complete.finish_reason == sampling_pb2.FINISH_REASON_EOS, text
        jsonschema.validate(json.loads(text), schema)


async def test_decode_refuses_kv_it_cannot_continue(llama_cpp_mesh, model_dir):
    """KV of another engine, library version or stream layout is FAILED_PRECONDITION with
    the reason; a state size past what the prompt can take is the caller's error."""
    prompt_ids = load_tokenizer(model_dir).encode("Hello there").ids
    async with prefill_and_decode(
        llama_cpp_mesh.target("prefill"), f"127.0.0.1:{llama_cpp_mesh.decode_ports[0]}"
    ) as (prefill, decode):
        leased = await prefill.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt_ids), timeout=30)
        handle = leased.kv_handle
        assert (handle.format.engine, handle.format.engine_version) == ("llama.cpp", ENGINE_VERSION)
        assert handle.format.layout == "streams=1"
        assert handle.format.model_sha256 == sha256_of(gguf_path())
        assert handle.format.state_bytes > 0 and handle.num_tokens == len(prompt_ids)

        def changed(**fields) -> kv_cache_pb2.KvHandle:
            altered = kv_cache_pb2.KvHandle()
            altered.CopyFrom(handle)
            for name, value in fields.items():
                setattr(altered.format, name, value)
            return altered

        for fields, named in (
            # Relabelled as torch KV: this worker reads torch KV, but of its model directory.
            ({"engine": ""}, "model sha256"),
            ({"engine_version": "llama-cpp-python 0.0.1"}, "engine_version"),
            ({"layout": "unified"}, "layout"),
            ({"model_sha256": "0" * 64}, "model sha256"),
        ):
            error = await decode_refusal(
                decode, changed(**fields), prompt_ids, leased.first_token_id
            )
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, fields
            assert error_info(error).reason == "KV_FORMAT_MISMATCH"
            assert named in error.details()
        error = await decode_refusal(
            decode, changed(state_bytes=2**40), prompt_ids, leased.first_token_id
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in field_violations(error)] == ["kv_handle.format.state_bytes"]
        # After every refusal the real handle still decodes.
        assert await still_decodes(decode, handle, prompt_ids, leased.first_token_id)


async def test_a_prompt_sharing_a_cached_prefix_computes_only_its_tail(
    llama_cpp_mesh, local, model_dir
):
    """Prefill's prefix cache across the processes: a second prompt with the first's
    preamble reports the preamble, to its last fixed cut, as cached (Usage, the
    prefix_cache stage, the hit metric), computes only the rest, and says what a whole
    prefill would."""
    tokenizer = load_tokenizer(model_dir)
    preamble = (
        "You are the support assistant of a bicycle shop. Answer from the manual excerpts "
        "below, in two sentences at most, and name the excerpt you used.\n"
        "Excerpt 1: a flat tyre is fixed by removing the wheel, levering the tyre off the "
        "rim, patching or replacing the inner tube and pumping it to the pressure printed "
        "on the tyre's side.\nExcerpt 2: rim brakes are adjusted at the barrel adjuster.\n"
    )
    first, second = (preamble + tail for tail in ("Q: How do I fix a flat?", "Q: Brakes?"))
    first_ids, second_ids = (tokenizer.encode(prompt).ids for prompt in (first, second))
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids, strict=False)) if a != b)
    shared = cut_at_or_before(common)
    hits = llama_cpp_mesh.metrics_url("prefill")
    hits_before = metric_at(hits, "aimesh_llm_prefix_cache_hits_total")
    stub, channel = llama_cpp_mesh.stub()
    async with channel:
        _, _, alone = await generate(stub, prompt=first, stopping=stopping(4))
        ids, _, after = await generate(stub, prompt=second, stopping=stopping(12, ignore_eos=True))
    assert alone.usage.cached_tokens == 0
    assert after.usage.cached_tokens == shared > 0
    stages = {stage.name: stage for stage in after.timing.stages}
    assert stages["prefix_cache"].tokens == shared
    assert stages["prefill"].tokens == len(second_ids) - shared
    assert metric_at(hits, "aimesh_llm_prefix_cache_hits_total") == hits_before + shared
    assert ids == greedy_alone(local, second_ids, 12)


async def test_torch_prefill_kv_continues_on_llama_cpp_as_it_does_in_process(
    mixed_mesh, local, model_dir, prompts
):
    """Engines mixed across processes: torch prefills, decode writes its KV as llama.cpp's
    state and joins it to the batch; each stream is what the same handoff gives in this
    process."""
    tokenizer = load_tokenizer(model_dir)
    torch_model = Llama.load(model_dir)
    _, decode = local

    stub, channel = mixed_mesh.stub()
    lengths = [24, 9, 17, 30, 5, 12]
    async with channel:
        runs = await asyncio.gather(
            *(
                generate(stub, prompt=prompt, stopping=stopping(n, ignore_eos=True))
                for prompt, n in zip(prompts, lengths, strict=False)
            )
        )
    for prompt, n, (ids, _, _) in zip(prompts, lengths, runs, strict=False):
        prompt_ids = tokenizer.encode(prompt).ids
        in_process = greedy_after(decode, prompt_ids, *torch_model.prefill(prompt_ids), n)
        assert ids == in_process, prompt


async def test_llama_cpp_decode_refuses_torch_kv_of_another_model(mixed_mesh, model_dir):
    prompt_ids = load_tokenizer(model_dir).encode("Hello there").ids
    async with prefill_and_decode(
        mixed_mesh.target("prefill"), f"127.0.0.1:{mixed_mesh.decode_ports[0]}"
    ) as (prefill, decode):
        leased = await prefill.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt_ids), timeout=30)
        handle = leased.kv_handle
        assert (handle.format.engine, handle.dtype) == ("torch", "float32")
        assert handle.format.model_sha256 == artifact_digest(model_dir)
        other = kv_cache_pb2.KvHandle()
        other.CopyFrom(handle)
        other.format.model_sha256 = "0" * 64
        error = await decode_refusal(decode, other, prompt_ids, leased.first_token_id)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(error).reason == "KV_FORMAT_MISMATCH"
        assert "model sha256" in error.details()
        assert await still_decodes(decode, handle, prompt_ids, leased.first_token_id)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colours"],
    "additionalProperties": False,
}


async def chat_text(stub, **request) -> tuple[str, generation_pb2.GenerationComplete]:
    text, complete = "", None
    async for message in stub.Chat(generation_pb2.ChatRequest(**request), timeout=120):
        if message.HasField("chunk"):
            text += message.chunk.text
        else:
            complete = message.complete
    assert complete is not None
    return text, complete


async def test_a_json_schema_constrains_greedy_and_sampled_chat(llama_cpp_mesh):
    """The model's own answer, greedy and sampled, is one JSON value valid against the
    schema, ended by the model's end token once it is complete."""
    constraint = sampling_pb2.OutputConstraint(json_schema=json.dumps(PERSON))
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    stub, channel = llama_cpp_mesh.stub()
    async with channel:
        for sampling in [
            sampling_pb2.SamplingParameters(constraint=constraint),
            *(
                sampling_pb2.SamplingParameters(temperature=1.0, seed=seed, constraint=constraint)
                for seed in range(3)
            ),
        ]:
            text, complete = await chat_text(
                stub, messages=messages, sampling=sampling, stopping=stopping(120)
            )
            assert complete.finish_reason == sampling_pb2.FINISH_REASON_EOS, text
            jsonschema.validate(json.loads(text), PERSON)


WEATHER = generation_pb2.ToolDefinition(
    name="get_weather",
    description="The current weather in a city.",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)


async def chat_calls(stub, **request):
    """A Chat stream with tools: (answer text, calls from the deltas, the complete)."""
    text, calls, complete = "", {}, None
    async for message in stub.Chat(generation_pb2.ChatRequest(**request), timeout=120):
        if message.HasField("complete"):
            complete = message.complete
            continue
        text += message.chunk.text
        for delta in message.chunk.tool_calls:
            if delta.id:
                calls[delta.index] = [delta.id, delta.name, ""]
            calls[delta.index][2] += delta.arguments
    return text, [tuple(call) for _, call in sorted(calls.items())], complete


async def test_the_model_calls_a_tool_and_answers_from_its_result(llama_cpp_mesh):
    """Required: the turn is a call of the tool, its arguments valid against its schema,
    the deltas joining into the calls the end reports. Then, the result in the history,
    auto: a well-formed turn either way (an answer in text, or calls that parse)."""
    stub, channel = llama_cpp_mesh.stub()
    question = common_pb2.ChatMessage(role="user", content="What is the weather in Paris?")
    async with channel:
        text, calls, complete = await chat_calls(
            stub,
            messages=[question],
            tools=[WEATHER],
            tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.ToolChoice.MODE_REQUIRED),
            stopping=stopping(80),
        )
        assert complete.finish_reason == sampling_pb2.FINISH_REASON_TOOL_CALLS and text == ""
        assert [(c.id, c.name, c.arguments) for c in complete.tool_calls] == calls
        (_, name, arguments), *_ = calls
        assert name == "get_weather" and set(json.loads(arguments)) == {"city"}
        history = [
            question,
            common_pb2.ChatMessage(role="assistant", tool_calls=complete.tool_calls),
            *(
                common_pb2.ChatMessage(role="tool", tool_call_id=c.id, content="Sunny, 24 C")
                for c in complete.tool_calls
            ),
        ]
        text, calls, complete = await chat_calls(
            stub, messages=history, tools=[WEATHER], stopping=stopping(120)
        )
    if complete.finish_reason == sampling_pb2.FINISH_REASON_TOOL_CALLS:
        assert text == "" and all(json.loads(arguments) for _, _, arguments in calls)
    else:
        assert complete.finish_reason == sampling_pb2.FINISH_REASON_EOS
        assert text and not calls and not complete.tool_calls
