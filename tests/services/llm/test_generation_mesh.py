"""The LLM mesh end to end: tokenizer, prefill, two decode replicas and the generation
router, each its own process, checked against transformers running in this process."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import time
import urllib.request

import grpc
import pytest
import torch

from aimesh.llm.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    kv_cache_pb2,
    kv_cache_pb2_grpc,
    prefill_pb2,
    sampling_pb2,
)
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.errors import field_violations
from mesh.info import get_info
from services.llm.artifacts import load_tokenizer, resolve_model
from services.llm.kv_transfer import new_handle_id
from tests.conftest import VENV_BIN, eventually
from tests.services.llm.conftest import (
    MAX_SEQ_LEN,
    decode_refusal,
    generate,
    greedy_reference,
    metric_at,
    prefill_and_decode,
    stopping,
)

pytestmark = pytest.mark.system


async def _loads(llm_mesh) -> list[decode_pb2.GetLoadResponse]:
    loads = []
    for port in llm_mesh.decode_ports:
        async with create_channel(f"127.0.0.1:{port}", MeshSettings()) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            loads.append(await stub.GetLoad(decode_pb2.GetLoadRequest(), timeout=5))
    return loads


async def _long_stream_under_way(stub, prompt: str):
    """A Generate call for 300 tokens that has already streamed three chunks."""
    call = stub.Generate(
        generation_pb2.GenerateRequest(prompt=prompt, stopping=stopping(300)), timeout=120
    )
    chunks = 0
    async for message in call:
        chunks += message.HasField("chunk")
        if chunks == 3:
            return call
    raise AssertionError("the stream ended before three chunks")


async def test_every_llm_service_says_which_model_it_serves(llm_mesh):
    """GetInfo: one model, one artifact digest, on every LLM hop; the workers say their
    dtype (this mesh pins float32) and where it runs."""
    infos = {
        name: await get_info(llm_mesh.target(name), timeout_s=5)
        for name in ("tokenizer", "prefill", "generation")
    }
    infos["decode"] = await get_info(f"127.0.0.1:{llm_mesh.decode_ports[0]}", timeout_s=5)
    models = {name: info.models[0] for name, info in infos.items()}
    assert all(info.loaded and len(info.models) == 1 for info in infos.values())
    assert {model.name for model in models.values()} == {"SmolLM2-135M-Instruct"}
    (digest,) = {model.sha256 for model in models.values()}
    assert len(digest) == 64
    assert (models["prefill"].dtype, models["decode"].dtype) == ("float32", "float32")
    assert (models["decode"].device, models["decode"].engine) == ("cpu", "torch")
    assert models["generation"].engine == "prefill+decode"
    assert models["decode"].limits["max_seq_len"] == str(MAX_SEQ_LEN)


async def test_greedy_output_equals_transformers_token_for_token(llm_mesh, reference, prompts):
    stub, channel = llm_mesh.stub()
    _, tokenizer = reference
    async with channel:
        for prompt in prompts[:3]:
            ids, text, complete = await generate(stub, prompt=prompt, stopping=stopping(24))
            prompt_ids = tokenizer(prompt)["input_ids"]
            assert ids == greedy_reference(reference, prompt_ids, 24)
            assert text == tokenizer.decode(ids, skip_special_tokens=True)
            assert complete.usage.prompt_tokens == len(prompt_ids)
            assert complete.usage.completion_tokens >= len(ids)
            assert complete.finish_reason in (
                sampling_pb2.FINISH_REASON_LENGTH,
                sampling_pb2.FINISH_REASON_EOS,
            )
            stages = {s.name: s for s in complete.timing.stages}
            assert set(stages) == {
                *("tokenize", "queue", "prefix_cache", "prefill"),
                *("kv_transfer", "decode", "detokenize"),
            }
            assert stages["prefill"].tokens == len(prompt_ids) - complete.usage.cached_tokens
            assert complete.model == "SmolLM2-135M-Instruct"


async def test_chat_applies_the_template_and_matches_transformers(llm_mesh, reference):
    stub, channel = llm_mesh.stub()
    _, tokenizer = reference
    messages = [{"role": "user", "content": "Name a primary colour."}]
    async with channel:
        ids: list[int] = []
        async for message in stub.Chat(
            generation_pb2.ChatRequest(messages=messages, stopping=stopping(16)), timeout=120
        ):
            if message.HasField("chunk"):
                ids += message.chunk.token_ids
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids["input_ids"]
    assert ids == greedy_reference(reference, prompt_ids, 16)


async def test_eight_concurrent_streams_each_equal_their_single_stream(llm_mesh, prompts):
    stub, channel = llm_mesh.stub()
    lengths = [6 + 4 * i for i in range(8)]
    async with channel:
        alone = [
            (await generate(stub, prompt=p, stopping=stopping(n)))[0]
            for p, n in zip(prompts, lengths, strict=True)
        ]
        together = await asyncio.gather(
            *(
                generate(stub, prompt=p, stopping=stopping(n))
                for p, n in zip(prompts, lengths, strict=True)
            )
        )
    assert [ids for ids, _, _ in together] == alone


async def test_seeded_sampling_reproduces(llm_mesh):
    stub, channel = llm_mesh.stub()

    def sampled(seed: int) -> sampling_pb2.SamplingParameters:
        return sampling_pb2.SamplingParameters(temperature=0.9, top_p=0.95, top_k=50, seed=seed)

    async with channel:
        runs = [
            (
                await generate(
                    stub, prompt="Tell me a story:", sampling=sampled(seed), stopping=stopping(24)
                )
            )[0]
            for seed in (1234, 1234, 99)
        ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def _prefill_calls(url: str) -> float:
    """Prefill RPCs the worker completed with OK, from its /metrics."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    pattern = r"^aimesh_rpc_server_handled_total\{([^}]*)\} ([0-9.e+-]+)$"
    return sum(
        float(value)
        for labels, value in re.findall(pattern, text, re.MULTILINE)
        if 'grpc_method="Prefill"' in labels and 'grpc_code="OK"' in labels
    )


async def test_n_choices_share_one_prefill_and_each_reproduces_alone(llm_mesh):
    """sampling.n = 3, seeded: one Prefill for the three; choice i's tokens are exactly
    those of a request of its own seeded seed + i; every choice ends with its own
    complete, each counting the prompt; the three handles to the KV are all released."""
    stub, channel = llm_mesh.stub()
    url = llm_mesh.metrics_url("prefill")
    prompt = "Tell me a story about a dragon:"

    def sampled(seed: int, n: int = 0) -> sampling_pb2.SamplingParameters:
        return sampling_pb2.SamplingParameters(temperature=0.9, top_k=50, seed=seed, n=n)

    async with channel:
        before = _prefill_calls(url)
        call = stub.Generate(
            generation_pb2.GenerateRequest(
                prompt=prompt, sampling=sampled(41, n=3), stopping=stopping(16)
            ),
            timeout=120,
        )
        ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
        completes: dict[int, generation_pb2.GenerationComplete] = {}
        async for message in call:
            if message.HasField("chunk"):
                ids[message.chunk.index] += message.chunk.token_ids
            else:
                completes[message.complete.index] = message.complete
        assert _prefill_calls(url) - before == 1
        alone = [
            await generate(stub, prompt=prompt, sampling=sampled(41 + i), stopping=stopping(16))
            for i in range(3)
        ]
    assert [ids[i] for i in range(3)] == [tokens for tokens, _, _ in alone]
    assert len({tuple(tokens) for tokens, _, _ in alone}) == 3
    assert sorted(completes) == [0, 1, 2]
    assert [completes[i].usage for i in range(3)] == [complete.usage for *_, complete in alone]
    await eventually(
        lambda: metric_at(url, "aimesh_llm_prefill_kv_leased_bytes") == 0, timeout_s=10
    )


async def test_sampling_without_a_seed_differs_from_request_to_request(llm_mesh):
    """An unset seed is a fresh one for each request (the sampler alone would read it as
    0, and every unseeded request drew the same tokens)."""
    stub, channel = llm_mesh.stub()
    free = sampling_pb2.SamplingParameters(temperature=1.0)
    async with channel:
        runs = [
            (await generate(stub, prompt="My favourite", sampling=free, stopping=stopping(12)))[0]
            for _ in range(3)
        ]
    assert len({tuple(ids) for ids in runs}) > 1


async def test_guided_choice_output_is_exactly_one_choice(llm_mesh):
    """Greedy or sampled, the text is one of the choices, and the model's own preference
    among them decides which: the capital of France is Paris."""
    choices = ["Paris", "Berlin", "Madrid", "knowledge_search"]
    stub, channel = llm_mesh.stub()
    async with channel:
        _, greedy, complete = await generate(
            stub,
            prompt="The capital of France is",
            sampling=sampling_pb2.SamplingParameters(choices=[" " + c for c in choices]),
        )
        sampled = [
            (
                await generate(
                    stub,
                    prompt="My favourite word is",
                    sampling=sampling_pb2.SamplingParameters(
                        choices=choices, temperature=1.5, seed=seed
                    ),
                )
            )[1]
            for seed in range(6)
        ]
    assert greedy == " Paris"
    assert complete.finish_reason == sampling_pb2.FINISH_REASON_EOS
    assert set(sampled) <= set(choices) and len(set(sampled)) > 1


async def test_a_prompt_past_the_context_window_is_invalid_argument(llm_mesh):
    """The one refusal that needs the prompt's tokens (the router's other checks run as
    unit calls in test_router_validation.py): it comes back through the mesh's error
    table with the field named."""
    stub, channel = llm_mesh.stub()
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate(stub, prompt="word " * (MAX_SEQ_LEN + 50))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in {v.field for v in field_violations(caught.value)}


async def test_unknown_and_expired_kv_handles_are_not_found(llm_mesh, reference):
    _, tokenizer = reference
    prompt_ids = tokenizer("Hello there")["input_ids"]
    async with prefill_and_decode(
        llm_mesh.target("prefill"), f"127.0.0.1:{llm_mesh.decode_ports[0]}"
    ) as (prefill, decode):
        leased = await prefill.Prefill(
            prefill_pb2.PrefillRequest(token_ids=prompt_ids, lease_ttl_ms=1), timeout=30
        )
        await asyncio.sleep(0.05)  # the 1 ms lease is over
        unknown = kv_cache_pb2.KvHandle()
        unknown.CopyFrom(leased.kv_handle)
        unknown.id = new_handle_id()  # well formed, never leased
        for handle in (unknown, leased.kv_handle):
            error = await decode_refusal(decode, handle, prompt_ids, leased.first_token_id)
            assert error.code() == grpc.StatusCode.NOT_FOUND
        # Decode pulls only from prefill workers it is configured with, and prefill
        # takes only ids it could have issued: each refusal names the field.
        elsewhere = kv_cache_pb2.KvHandle()
        elsewhere.CopyFrom(leased.kv_handle)
        elsewhere.address = "127.0.0.1:1"
        made_up = kv_cache_pb2.KvHandle()
        made_up.CopyFrom(leased.kv_handle)
        made_up.id = "a" * 16
        for handle, field in ((elsewhere, "kv_handle.address"), (made_up, "kv_handle.id")):
            error = await decode_refusal(decode, handle, prompt_ids, leased.first_token_id)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [v.field for v in field_violations(error)] == [field]
        # The router resolves the length: decode checks only that it fits its context.
        for length in (0, MAX_SEQ_LEN):
            error = await decode_refusal(
                decode, leased.kv_handle, prompt_ids, leased.first_token_id, length
            )
            assert [v.field for v in field_violations(error)] == ["max_new_tokens"]
    async with create_channel(llm_mesh.target("prefill"), MeshSettings()) as channel:
        kv_cache = kv_cache_pb2_grpc.KvCacheServiceStub(channel)
        for made_up in ("x" * 1024 * 1024, "é" * 32, "a" * 16):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await kv_cache.Release(kv_cache_pb2.ReleaseRequest(handle_id=made_up), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cancelling_a_stream_frees_its_decode_slot_within_a_step(llm_mesh):
    stub, channel = llm_mesh.stub()
    async with channel:
        call = await _long_stream_under_way(stub, "Count slowly:")
        assert sum(load.running for load in await _loads(llm_mesh)) == 1
        call.cancel()
        started = time.monotonic()

        async def idle() -> bool:
            return sum(load.running for load in await _loads(llm_mesh)) == 0

        while not await idle():
            assert time.monotonic() - started < 2.0, "slot still busy 2 s after cancel"
            await asyncio.sleep(0.02)


def _handled(url: str, method: str) -> float:
    """aimesh_rpc_server_handled_total of `method`, over every status code."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    pattern = rf'^aimesh_rpc_server_handled_total{{[^}}]*grpc_method="{method}"[^}}]*}} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))


async def test_a_stop_sequence_is_cut_exactly_where_it_begins_and_decode_is_cancelled(
    llm_mesh, reference
):
    """The stop string starts inside a token: the text before it is sent, to the
    character, and decode, asked for 300 tokens, is cancelled by the router at once."""
    _, tokenizer = reference
    prompt = "The capital of France is"
    stub, channel = llm_mesh.stub()
    async with channel:
        ids, full, _ = await generate(stub, prompt=prompt, stopping=stopping(24, ignore_eos=True))
        boundaries = {
            len(tokenizer.decode(ids[:n], skip_special_tokens=True)) for n in range(len(ids))
        }
        at = next(
            k
            for k in range(len(full) // 3, len(full) - 6)
            if k not in boundaries and full[k - 1].isalnum() and full.index(full[k : k + 6]) == k
        )
        stop = full[at : at + 6]
        ids, text, complete = await generate(
            stub,
            prompt=prompt,
            stopping=stopping(300, ignore_eos=True, stop_sequences=[stop]),
        )
        assert text == full[:at], (full, stop)
        assert complete.finish_reason == sampling_pb2.FINISH_REASON_STOP_SEQUENCE
        assert len(ids) == complete.usage.completion_tokens < 40
        started = time.monotonic()
        while sum(load.running for load in await _loads(llm_mesh)) != 0:
            assert time.monotonic() - started < 2.0, "decode still generating after the stop"
            await asyncio.sleep(0.02)


async def test_text_is_made_once_by_the_router_without_detokenize_stream(llm_mesh):
    """A generation's ids become text in the router: the tokenizer serves Tokenize and
    never DetokenizeStream, and the text is a one-shot decode of the streamed ids, even
    where characters span tokens."""
    tokenizer = load_tokenizer(resolve_model(None, MeshSettings().cache_dir))
    tokenizer_metrics = llm_mesh.metrics_url("tokenizer")
    tokenized_before = _handled(tokenizer_metrics, "Tokenize")
    stub, channel = llm_mesh.stub()
    async with channel:
        for prompt in ("Translate to Japanese: good morning ->", "Emoji for a happy face:"):
            ids, text, _ = await generate(
                stub, prompt=prompt, stopping=stopping(24, ignore_eos=True)
            )
            assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert _handled(tokenizer_metrics, "Tokenize") >= tokenized_before + 2
    assert _handled(tokenizer_metrics, "DetokenizeStream") == 0


async def test_no_leaks_after_200_streams_cancelled_at_random_points(llm_mesh, prompts):
    urls = {name: llm_mesh.metrics_url(name) for name in ("prefill", "decode-0", "decode-1")}
    tasks_before = {n: metric_at(u, "aimesh_runtime_asyncio_tasks") for n, u in urls.items()}
    stub, channel = llm_mesh.stub()
    rng = random.Random(7)

    async def one(i: int) -> None:
        # Half the requests ask for several choices (one prefill, a handle each).
        choices = sampling_pb2.SamplingParameters(n=(1, 2, 1, 3)[i % 4])
        call = stub.Generate(
            generation_pb2.GenerateRequest(
                prompt=prompts[i % len(prompts)], sampling=choices, stopping=stopping(12)
            ),
            timeout=60,
        )

        async def consume() -> None:
            async for _ in call:
                pass

        task = asyncio.create_task(consume())
        # 0 ms lands before prefill, tens of ms during prefill or the KV pull, more mid-decode.
        await asyncio.sleep(rng.choice([0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.4]))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async with channel:
        for wave in range(25):
            await asyncio.gather(*(one(wave * 8 + j) for j in range(8)))

        async def idle() -> bool:
            loads = await _loads(llm_mesh)
            return (
                all(load.running == 0 and load.waiting == 0 for load in loads)
                and metric_at(urls["prefill"], "aimesh_llm_prefill_kv_leased_bytes") == 0
            )

        deadline = time.monotonic() + 10
        while not await idle():
            if time.monotonic() > deadline:
                leased = metric_at(urls["prefill"], "aimesh_llm_prefill_kv_leased_bytes")
                pytest.fail(f"still held 10 s after: {await _loads(llm_mesh)}, {leased} KV bytes")
            await asyncio.sleep(0.1)
    for name, url in urls.items():
        after = metric_at(url, "aimesh_runtime_asyncio_tasks")
        assert after <= tasks_before[name] + 2, f"{name}: {tasks_before[name]} -> {after} tasks"


async def test_aimesh_generate_cli_prints_text_usage_timing_and_trace_id(llm_mesh, reference):
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"),
        "generate",
        "--json",
        "--max-new-tokens",
        "8",
        "The capital of France is",
        env=llm_mesh.env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    result = json.loads(out)
    _, tokenizer = reference
    expected = greedy_reference(reference, tokenizer("The capital of France is")["input_ids"], 8)
    assert result["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert result["usage"]["completion_tokens"] >= len(expected)
    assert {"tokenize", "prefill", "kv_transfer", "decode", "total"} <= set(result["timing"])
    assert len(result["trace_id"]) == 32

    bad = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"),
        "generate",
        "--temperature",
        "-1",
        "hi",
        env=llm_mesh.env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(bad.communicate(), 60)
    assert bad.returncode == 1
    assert "INVALID_ARGUMENT" in err.decode() and "sampling.temperature" in err.decode()


async def test_killing_a_decode_replica_fails_its_stream_and_the_other_keeps_serving(llm_mesh):
    """Kills one decode process, and starts it again at the end for the tests after it."""
    stub, channel = llm_mesh.stub()
    async with channel:
        call = await _long_stream_under_way(stub, "Write a long essay:")
        loads = await _loads(llm_mesh)
        victim = next(i for i, load in enumerate(loads) if load.running == 1)
        llm_mesh.processes.signal(f"decode-{victim}", signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
            assert time.monotonic() - killed_at < 10
            assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)

            survivor = f"127.0.0.1:{llm_mesh.decode_ports[1 - victim]}"
            for _ in range(4):
                ids, _, complete = await generate(stub, prompt="Hello", stopping=stopping(4))
                assert ids and complete.decode_worker == survivor
        finally:
            await llm_mesh.start(f"decode-{victim}", "decode", llm_mesh.decode_ports[victim])


async def test_a_conversation_over_the_tokenizers_bound_is_the_callers_error(llm_mesh):
    """Each message under 1 MiB, both together over: the tokenizer refuses the pair, so the
    router must say so first, not pass the tokenizer's refusal on as INTERNAL."""
    stub, channel = llm_mesh.stub()
    half = "x " * 300_000
    request = generation_pb2.ChatRequest(
        messages=[{"role": "user", "content": half}, {"role": "user", "content": half}]
    )
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Chat(request, timeout=60):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages" in {v.field for v in field_violations(caught.value)}


async def test_a_subnormal_temperature_generates_the_greedy_tokens(llm_mesh):
    stub, channel = llm_mesh.stub()
    async with channel:
        greedy, _, _ = await generate(stub, prompt="The capital of France is", stopping=stopping(8))
        tiny, _, _ = await generate(
            stub,
            prompt="The capital of France is",
            sampling=sampling_pb2.SamplingParameters(temperature=1e-40, seed=3),
            stopping=stopping(8),
        )
    assert tiny == greedy


async def test_a_constrained_and_an_unconstrained_stream_share_a_batch(llm_mesh, prompts):
    """Constrained rows in the running batch change nothing for their neighbours: each
    unconstrained stream equals itself alone, and each constrained one keeps its form."""
    pattern = r"[0-9]{2,3}(, [0-9]{2,3}){2}"
    constrained = sampling_pb2.SamplingParameters(
        constraint=sampling_pb2.OutputConstraint(regex=pattern)
    )
    stub, channel = llm_mesh.stub()
    async with channel:
        alone = [(await generate(stub, prompt=p, stopping=stopping(20)))[0] for p in prompts[:4]]
        together = await asyncio.gather(
            *(generate(stub, prompt=p, stopping=stopping(20)) for p in prompts[:4]),
            *(
                generate(stub, prompt=p, sampling=constrained, stopping=stopping(20))
                for p in prompts[4:]
            ),
        )
    assert [ids for ids, _, _ in together[:4]] == alone
    for _, text, complete in together[4:]:
        assert (
            re.fullmatch(pattern, text) and complete.finish_reason == sampling_pb2.FINISH_REASON_EOS
        )


async def test_logprobs_are_the_models_own_and_their_bytes_make_the_text(llm_mesh, reference):
    """Every token's logprob and its alternatives (the first from prefill, the rest from
    decode) are transformers' log-softmax at that position; the greedy token is the most
    likely; the tokens' bytes, concatenated, are the text."""
    model, tokenizer = reference
    prompt = "Héllo! The word for 'thank you' in Japanese is"
    sampling = sampling_pb2.SamplingParameters(logprobs=True, top_logprobs=3)
    stub, channel = llm_mesh.stub()
    entries = []
    text = ""
    async with channel:
        async for message in stub.Generate(
            generation_pb2.GenerateRequest(prompt=prompt, sampling=sampling, stopping=stopping(12)),
            timeout=120,
        ):
            if message.HasField("chunk"):
                assert len(message.chunk.logprobs) == len(message.chunk.token_ids)
                entries += message.chunk.logprobs
                text += message.chunk.text
    assert len(entries) >= 2
    assert b"".join(e.bytes for e in entries).decode() == text
    ids = tokenizer(prompt)["input_ids"] + [e.token_id for e in entries]
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    first = len(ids) - len(entries) - 1
    for position, entry in enumerate(entries, start=first):
        assert [t.token_id for t in entry.top_logprobs] == (
            torch.topk(expected[position], 3).indices.tolist()
        )
        assert entry.top_logprobs[0].token_id == entry.token_id
        assert entry.logprob == pytest.approx(float(expected[position][entry.token_id]), abs=2e-3)
        assert entry.token == entry.bytes.decode("utf-8", errors="replace")
