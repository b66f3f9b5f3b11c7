"""Generation with the LLM on a real Triton server (a decoupled model over
ModelStreamInfer): the mesh's tokenizer and router in front, token by token back to the
client, cancellation and deadlines reaching Triton, and Triton's outages as the mesh's own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from aimesh.llm.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from loadtest.triton_server import TritonServer
from mesh.errors import error_info, field_violations
from mesh.health import probe, wait_until_serving
from tests.conftest import VENV_BIN, free_port, subprocess_env
from tests.services.llm.conftest import greedy_reference, model_dir, reference  # noqa: F401
from tests.triton.conftest import until

pytestmark = pytest.mark.system

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@dataclass
class TritonMesh:
    target: str
    triton_url: str
    log: Path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(triton, tmp_path_factory) -> AsyncIterator[TritonMesh]:
    """`aimesh serve tokenizer` and `aimesh serve generation` with backend = "triton"."""
    await triton.wait_ready("text_generation")
    root = tmp_path_factory.mktemp("triton-generation")
    ports = {"tokenizer": free_port(), "generation": free_port()}
    config = root / "aimesh.toml"
    config.write_text(
        f"[services.tokenizer]\nport = {ports['tokenizer']}\nmetrics_port = 0\n"
        f"[services.generation]\nport = {ports['generation']}\nmetrics_port = 0\n"
        'backend = "triton"\n'
        "[services.generation.triton]\n"
        f'url = "{triton.url}"\nmodel = "text_generation"\ntimeout_s = 120\n'
    )
    env = subprocess_env(AIMESH_CONFIG=str(config), OTEL_TRACES_EXPORTER="none")
    processes = [
        await asyncio.create_subprocess_exec(
            str(VENV_BIN / "aimesh"), "serve", name, env=env,
            stderr=(root / f"{name}.log").open("wb"),
        )
        for name in ports
    ]  # fmt: skip
    target = f"127.0.0.1:{ports['generation']}"
    try:
        ready = await wait_until_serving(target, "generation", timeout_s=180)
        assert ready, (root / "generation.log").read_text()[-3000:]
        yield TritonMesh(target, triton.url, triton.log)
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
            await process.wait()


def generate_call(target: str, timeout_s: float = 120, **request):
    channel = grpc.aio.insecure_channel(target)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    return channel, stub.Generate(generation_pb2.GenerateRequest(**request), timeout=timeout_s)


async def wait_for_log(log: Path, text: str, timeout_s: float = 30) -> str:
    """The first line of Triton's log that holds `text`, once it is there."""
    give_up = time.monotonic() + timeout_s
    while True:
        lines = (await asyncio.to_thread(log.read_text)).splitlines()
        found = [line for line in lines if text in line]
        if found:
            return found[0]
        assert time.monotonic() < give_up, f"{text!r} not in Triton's log"
        await asyncio.sleep(0.2)


async def collect(call) -> tuple[str, generation_pb2.GenerationComplete]:
    text = ""
    async for message in call:
        if message.HasField("chunk"):
            text += message.chunk.text
        else:
            complete = message.complete
    return text, complete


async def test_greedy_output_streams_token_by_token_and_equals_transformers(mesh, reference):  # noqa: F811
    _, tokenizer = reference
    for prompt in PROMPTS:
        channel, call = generate_call(
            mesh.target, prompt=prompt, stopping=sampling_pb2.StoppingCriteria(max_new_tokens=16)
        )
        chunks: list[list[int]] = []
        text = ""
        async with channel:
            async for message in call:
                if message.HasField("chunk"):
                    if message.chunk.token_ids:
                        chunks.append(list(message.chunk.token_ids))
                    text += message.chunk.text
                else:
                    complete = message.complete
        ids = [token for chunk in chunks for token in chunk]
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert ids == greedy_reference(reference, prompt_ids, 16)
        assert all(len(chunk) == 1 for chunk in chunks), "one message per token"
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert complete.usage.prompt_tokens == len(prompt_ids)
        assert complete.usage.completion_tokens == len(ids)
        assert complete.finish_reason in (
            sampling_pb2.FINISH_REASON_LENGTH,
            sampling_pb2.FINISH_REASON_EOS,
        )
        assert complete.decode_worker == mesh.triton_url
        assert {s.name for s in complete.timing.stages} == {
            "tokenize", "prefill", "decode", "detokenize"
        }  # fmt: skip


async def test_seeded_sampling_reproduces_and_differs_by_seed(mesh):
    async def sampled(seed: int) -> str:
        channel, call = generate_call(
            mesh.target,
            prompt="Once upon a time",
            sampling=sampling_pb2.SamplingParameters(
                temperature=1.0, top_p=0.9, seed=seed, frequency_penalty=0.5
            ),
            stopping=sampling_pb2.StoppingCriteria(max_new_tokens=12, ignore_eos=True),
        )
        async with channel:
            text, _ = await collect(call)
        return text

    first = await sampled(7)
    assert first == await sampled(7)
    assert first != await sampled(8)


async def test_cancelling_the_client_stops_the_request_on_triton(mesh):
    channel, call = generate_call(
        mesh.target,
        request_id="cancel-on-triton",
        prompt="Count to a thousand:",
        stopping=sampling_pb2.StoppingCriteria(max_new_tokens=400, ignore_eos=True),
    )
    async with channel:
        chunks = 0
        async for message in call:
            chunks += message.HasField("chunk")
            if chunks == 3:
                call.cancel()
                break
    line = await wait_for_log(mesh.log, "text_generation cancel-on-triton: cancelled after")
    stopped_after = int(line.split("cancelled after ")[1].split(" tokens")[0])
    assert 3 <= stopped_after < 100, line


async def test_a_deadline_that_passes_mid_stream_stops_the_request_on_triton(mesh):
    channel, call = generate_call(
        mesh.target,
        timeout_s=2.0,
        request_id="deadline-on-triton",
        prompt="Count to a thousand:",
        stopping=sampling_pb2.StoppingCriteria(max_new_tokens=400, ignore_eos=True),
    )
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as late:
            async for _ in call:
                pass
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    line = await wait_for_log(mesh.log, "text_generation deadline-on-triton: cancelled after")
    assert int(line.split("cancelled after ")[1].split(" tokens")[0]) < 400


async def test_a_stop_sequence_ends_the_text_before_it_and_the_request_on_triton(mesh):
    greedy = {"prompt": "The capital of France is", "sampling": sampling_pb2.SamplingParameters()}
    channel, call = generate_call(
        mesh.target, **greedy, stopping=sampling_pb2.StoppingCriteria(max_new_tokens=12)
    )
    async with channel:
        full, _ = await collect(call)
    stop = full[len(full) // 2 :][:4]
    assert stop.strip(), full
    channel, call = generate_call(
        mesh.target,
        **greedy,
        request_id="stop-on-triton",
        stopping=sampling_pb2.StoppingCriteria(
            max_new_tokens=300, ignore_eos=True, stop_sequences=[stop]
        ),
    )
    async with channel:
        text, complete = await collect(call)
    assert complete.finish_reason == sampling_pb2.FINISH_REASON_STOP_SEQUENCE
    before = full[: full.index(stop)]
    # Matching is by whole tokens: the token that starts the stop sequence goes with it.
    assert before.startswith(text) and len(before) - len(text) < 16, (full, stop, text)
    line = await wait_for_log(mesh.log, "text_generation stop-on-triton: cancelled after")
    assert int(line.split("cancelled after ")[1].split(" tokens")[0]) < 300


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (sampling_pb2.SamplingParameters(choices=["yes", "no"]), "sampling.choices"),
        (sampling_pb2.SamplingParameters(logprobs=True), "sampling.logprobs"),
    ],
)
async def test_options_that_need_the_logits_are_refused_by_field(mesh, sampling, field):
    channel, call = generate_call(mesh.target, prompt="Hello", sampling=sampling)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(call)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields = {violation.field for violation in field_violations(refused.value)}
    assert fields == {field}


async def test_triton_down_is_unavailable_at_once_and_not_ready_then_recovers(
    mesh, triton: TritonServer
):
    triton.stop()
    try:
        started = time.monotonic()
        channel, call = generate_call(mesh.target, prompt="Hello")
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as down:
                async for _ in call:
                    pass
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(down.value).reason == "TRITON_UNAVAILABLE"
        assert time.monotonic() - started < 5, "promptly, not after a timeout"

        async def not_ready() -> bool:
            return await probe(mesh.target, "generation") == "NOT_SERVING"

        await until(not_ready, timeout_s=10)
        assert await probe(mesh.target, "") == "SERVING", "alive all along"
    finally:
        triton.start()
        await triton.wait_all_ready()
    assert await wait_until_serving(mesh.target, "generation", timeout_s=30)
    channel, call = generate_call(
        mesh.target, prompt="Hello", stopping=sampling_pb2.StoppingCriteria(max_new_tokens=2)
    )
    async with channel:
        assert [m async for m in call][-1].HasField("complete")
