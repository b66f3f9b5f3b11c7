"""The LLM mesh serving bfloat16: a request alone gets transformers' bfloat16 greedy output
token for token, through tokenizer, prefill, the KV handoff, decode and detokenizer. (The
engine's own test checks every step's logits bit for bit on all the test prompts.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from aimesh.llm.v1 import decode_pb2, kv_cache_pb2, prefill_pb2
from mesh.errors import field_violations
from tests.conftest import free_port
from tests.services.llm.conftest import (
    LlmMesh,
    generate,
    greedy_reference,
    prefill_and_decode,
    running_llm_mesh,
    stopping,
)

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def bfloat16_mesh(tmp_path_factory, model_dir) -> Iterator[LlmMesh]:
    with running_llm_mesh(tmp_path_factory.mktemp("bf16-mesh"), "bfloat16") as mesh:
        yield mesh


async def test_greedy_output_equals_transformers_in_bfloat16(
    bfloat16_mesh, bfloat16_reference, prompts
):
    _, tokenizer = bfloat16_reference
    stub, channel = bfloat16_mesh.stub()
    async with channel:
        for prompt in prompts[:4]:
            ids, text, _ = await generate(stub, prompt=prompt, stopping=stopping(24))
            expected = greedy_reference(bfloat16_reference, tokenizer(prompt)["input_ids"], 24)
            assert ids == expected, prompt
            assert text == tokenizer.decode(ids, skip_special_tokens=True)


async def test_a_float32_decode_takes_bfloat16_kv_from_prefill(bfloat16_mesh, bfloat16_reference):
    """dtype "auto" resolves in each process, so prefill on bfloat16 hardware can hand its
    KV to a float32 decode: decode converts it as it copies it into its cache."""
    _, tokenizer = bfloat16_reference
    port = free_port()
    await bfloat16_mesh.start(
        "decode-float32",
        "decode",
        port,
        AIMESH_ENGINES__LLM__DTYPE="float32",
        AIMESH_SERVICES__DECODE__METRICS_PORT="0",
    )
    prompt_ids = tokenizer("The capital of France is")["input_ids"]
    async with prefill_and_decode(bfloat16_mesh.target("prefill"), f"127.0.0.1:{port}") as (
        prefill,
        decode,
    ):
        leased = await prefill.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt_ids), timeout=30)
        assert leased.kv_handle.dtype == "bfloat16"

        def request(handle: kv_cache_pb2.KvHandle) -> decode_pb2.DecodeRequest:
            return decode_pb2.DecodeRequest(
                kv_handle=handle,
                prompt_token_ids=prompt_ids,
                first_token_id=leased.first_token_id,
                max_new_tokens=8,
                ignore_eos=True,
            )

        unknown = kv_cache_pb2.KvHandle()
        unknown.CopyFrom(leased.kv_handle)
        unknown.dtype = "int3"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in decode.Decode(request(unknown), timeout=30):
                pass
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kv_handle.dtype" in {v.field for v in field_violations(caught.value)}

        tokens: list[int] = []
        async for message in decode.Decode(request(leased.kv_handle), timeout=60):
            if message.HasField("chunk"):
                tokens.extend(message.chunk.token_ids)
            else:
                assert message.complete.generated_tokens == 8
    assert len(tokens) == 8 and tokens[0] == leased.first_token_id
    assert tokenizer.decode(tokens).strip()
    assert loaded_dtype(bfloat16_mesh, "decode-float32") == "float32"
    assert loaded_dtype(bfloat16_mesh, "prefill") == "bfloat16"


def loaded_dtype(mesh: LlmMesh, name: str) -> str:
    """The dtype a process's "model loaded" log line says it serves."""
    lines = (mesh.logs / f"{name}.log").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]  # not warnings
    (record,) = [r for r in records if r["message"] == "model loaded"]
    return record["dtype"]
