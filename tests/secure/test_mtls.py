"""The security table of docs/security.md, against `aimesh up --tls --edge`: the demo's
paths work over mutual TLS end to end, and each way around the rules is refused."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl

import grpc
import httpx
import openai
import pytest

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from aimesh.llm.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    kv_cache_pb2,
    kv_cache_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
)
from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from aimesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh import caller
from mesh.authz import OPERATOR
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.errors import error_info
from mesh.pki import throwaway_pki
from mesh.tls import plain_channel
from services.llm.artifacts import DEFAULT_NAME
from tests.conftest import VENV_BIN
from tests.secure.conftest import API_KEY, SecureMesh

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="package")]

PROMPT = generation_pb2.GenerateRequest(
    prompt="The capital of France is",
    stopping=sampling_pb2.StoppingCriteria(max_new_tokens=8),
)


async def generated_text(channel: grpc.aio.Channel, metadata=()) -> str:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    chunks = [c async for c in stub.Generate(PROMPT, timeout=120, metadata=metadata)]
    return "".join(c.chunk.text for c in chunks if c.HasField("chunk"))


async def test_the_edge_reaches_the_mesh_over_mutual_tls(secure: SecureMesh):
    """A client with an API key, as the demo's, over TLS to Envoy (trusting the CA up
    printed): gRPC through Envoy to the router (and on to tokenizer, prefill, decode), and
    the openai SDK to the gateway's HTTP API (and on to generation and diffusion), every hop
    behind Envoy on mTLS. The same key in plaintext gets no answer."""
    async with secure.edge_channel() as channel:
        text = await generated_text(channel, (("authorization", f"Bearer {API_KEY}"),))
    assert text.strip()
    async with grpc.aio.insecure_channel(secure.edge) as channel:
        refused = await refusal(generated_text(channel, (("authorization", f"Bearer {API_KEY}"),)))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    client = openai.AsyncOpenAI(
        base_url=f"https://{secure.edge}/v1", api_key=API_KEY, http_client=secure.edge_http()
    )
    async with client:
        chat = await client.chat.completions.create(
            model=DEFAULT_NAME,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            temperature=0,
        )
        assert chat.choices[0].message.content.strip()
        image = await client.images.generate(
            model="digits", prompt="7", n=1, response_format="b64_json"
        )
    assert base64.b64decode(image.data[0].b64_json).startswith(b"\x89PNG")


async def test_the_agent_answers_across_every_hop_over_mutual_tls(secure: SecureMesh):
    """agent -> tools -> retrieval -> embedder and rerank, agent -> generation -> ...:
    each hop allowed by its callee's list, with the operator's certificate at the door."""
    async with create_channel(secure.target("agent"), secure.as_(OPERATOR)) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        request = agent_pb2.RunRequest(
            question="How do I deep copy a nested list?",
            options=agent_pb2.RunOptions(max_new_tokens=24, seed=1),
        )
        events = [event async for event in stub.Run(request, timeout=300)]
    (citations,) = [e.citations for e in events if e.WhichOneof("event") == "citations"]
    assert "copy.deepcopy" in citations.passage_ids
    assert events[-1].WhichOneof("event") == "final"


async def refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value


async def test_callers_without_a_certificate_of_the_mesh_ca_are_refused(secure, tmp_path):
    stranger = throwaway_pki(tmp_path, [OPERATOR])[OPERATOR]
    for settings in (MeshSettings(), MeshSettings(tls=stranger)):
        async with create_channel(secure.target("generation"), settings) as channel:
            error = await refusal(generated_text(channel))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    # The gateway's HTTP API too: plaintext, and TLS without a client certificate.
    with pytest.raises(httpx.TransportError):
        async with httpx.AsyncClient() as client:
            await client.get(f"http://127.0.0.1:{secure.http_port}/v1/models")
    context = ssl.create_default_context(cafile=secure.tls(OPERATOR).ca_file)
    with pytest.raises(httpx.TransportError):
        async with httpx.AsyncClient(verify=context) as client:
            response = await client.get(f"https://127.0.0.1:{secure.http_port}/v1/models")
            response.raise_for_status()


async def test_a_certificate_reaches_only_what_its_identity_is_allowed(secure: SecureMesh):
    """The operator's certificate drives the edge's services but not the LLM's insides;
    the router's cannot pull KV; decode's cannot ask for prompts."""
    operator = secure.tls(OPERATOR)
    async with plain_channel(secure.target("generation"), operator) as channel:
        assert (await generated_text(channel)).strip()
    denied = {
        (OPERATOR, "prefill"): lambda c: prefill_pb2_grpc.PrefillServiceStub(c).Prefill(
            prefill_pb2.PrefillRequest(token_ids=[1, 2, 3]), timeout=30
        ),
        (OPERATOR, "decode"): lambda c: decode_pb2_grpc.DecodeServiceStub(c).GetLoad(
            decode_pb2.GetLoadRequest(), timeout=30
        ),
        (OPERATOR, "tokenizer"): lambda c: tokenizer_pb2_grpc.TokenizerServiceStub(c).Tokenize(
            tokenizer_pb2.TokenizeRequest(text="hi"), timeout=30
        ),
        ("decode", "prefill"): lambda c: prefill_pb2_grpc.PrefillServiceStub(c).Prefill(
            prefill_pb2.PrefillRequest(token_ids=[1, 2, 3]), timeout=30
        ),
        ("tools", "retrieval"): lambda c: retrieval_pb2_grpc.RetrievalServiceStub(c).Delete(
            retrieval_pb2.DeleteRequest(collection="knowledge", ids=["copy.deepcopy"]), timeout=30
        ),
    }
    for (identity, service), call in denied.items():
        async with plain_channel(secure.target(service), secure.tls(identity)) as channel:
            error = await refusal(call(channel))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (identity, service)
        assert error_info(error).metadata["caller"] == identity


async def pull(channel: grpc.aio.Channel, handle_id: str, client: str) -> list:
    stub = kv_cache_pb2_grpc.KvCacheServiceStub(channel)
    request = kv_cache_pb2.PullRequest(handle_id=handle_id)
    metadata = ((caller.METADATA_KEY, client),)
    return [m async for m in stub.Pull(request, timeout=30, metadata=metadata)]


async def test_a_kv_handle_is_pulled_by_decode_only_and_for_its_own_client(secure):
    """The KV a Prefill made for tenant-a: decode pulls it for tenant-a only (NOT_FOUND
    for tenant-b, as if it did not exist); the router that made it may not pull it."""
    async with (
        plain_channel(secure.target("prefill"), secure.tls("generation")) as router,
        plain_channel(secure.target("prefill"), secure.tls("decode")) as decode,
    ):
        made = await prefill_pb2_grpc.PrefillServiceStub(router).Prefill(
            prefill_pb2.PrefillRequest(token_ids=[1, 2, 3, 4]),
            timeout=60,
            metadata=((caller.METADATA_KEY, "tenant-a"),),
        )
        handle = made.kv_handle.id
        assert (await refusal(pull(decode, handle, "tenant-b"))).code() == (
            grpc.StatusCode.NOT_FOUND
        )
        assert (await refusal(pull(router, handle, "tenant-a"))).code() == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        messages = await pull(decode, handle, "tenant-a")
        assert messages[-1].HasField("complete") and messages[-1].complete.total_bytes > 0
        released = await kv_cache_pb2_grpc.KvCacheServiceStub(decode).Release(
            kv_cache_pb2.ReleaseRequest(handle_id=handle),
            timeout=30,
            metadata=((caller.METADATA_KEY, "tenant-a"),),
        )
        assert released.released


async def grpcurl(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "grpcurl"),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode, output.decode()


async def test_grpcurl_with_the_mesh_ca_and_a_certificate(secure: SecureMesh):
    """An engineer's grpcurl: -cacert, -cert and -key; without them, no answer."""
    tls = secure.tls(OPERATOR)
    flags = ["-cacert", str(tls.ca_file), "-cert", str(tls.cert_file), "-key", str(tls.key_file)]
    target = secure.target("generation")
    code, output = await grpcurl(*flags, target, "list")
    assert code == 0 and "aimesh.llm.v1.GenerationService" in output, output
    request = json.dumps({"prompt": "Two plus two is", "stopping": {"max_new_tokens": 4}})
    code, output = await grpcurl(
        *flags, "-d", request, target, "aimesh.llm.v1.GenerationService/Generate"
    )
    assert code == 0 and '"text"' in output, output
    code, output = await grpcurl("-plaintext", target, "list")
    assert code != 0
