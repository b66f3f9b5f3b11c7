"""Tenants on the real LLM mesh (tokenizer, prefill, two decodes, the router as processes):
prefill's prefix cache scoped by tenant and cache_salt, and the router's meter - budgets
charged in real tokens, never overspent, every computed token paid for however a client
leaves, and the ledger (a SQLite file every process shares) equal to the responses' usage
and to the counters."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from aimesh.common.v1 import common_pb2
from aimesh.llm.v1 import generation_pb2
from mesh import caller
from mesh.errors import error_info, retry_delay_s
from mesh.ledger import SqliteStore
from services.llm.passes import cut_at_or_before
from tests.conftest import eventually
from tests.services.llm.conftest import LlmMesh, collected, metric_at, running_llm_mesh, stopping

pytestmark = pytest.mark.system

TENANTS = """
[tenants.tiny]
token_budget = 200
[tenants.burst]
token_budget = 300
[tenants.paced]
tokens_per_minute = 60
[tenants.capped]
token_budget = 100000
"""
RESERVE_TOKENS = 4
SECRET = (
    "Internal memo for acme only: the launch code is 7-4-1-9 and the merger closes on "
    "Friday; do not forward this paragraph to anyone outside the finance team. The board "
    "meets on Monday at nine in the small room on the fourth floor, and the press release "
    "stays in the legal team's drawer until the regulator has signed the last form."
)


@pytest.fixture(scope="module")
def tenancy_mesh(tmp_path_factory, model_dir) -> Iterator[tuple[LlmMesh, Path]]:
    """The LLM mesh with tenants' limits, its ledger in a SQLite file of the test's own."""
    root = tmp_path_factory.mktemp("tenancy")
    (root / "tenants.toml").write_text(TENANTS)
    ledger = root / "limits.sqlite"
    config = (
        f'[limits]\ntenants_file = "{root / "tenants.toml"}"\nstore = "sqlite:{ledger}"\n'
        f"reserve_tokens = {RESERVE_TOKENS}\n"
    )
    with running_llm_mesh(root, extra_config=config) as mesh:
        yield mesh, ledger


def as_tenant(tenant: str) -> tuple[tuple[str, str], ...]:
    return ((caller.METADATA_KEY, tenant),)


async def generate(stub, tenant: str, **request) -> generation_pb2.GenerationComplete:
    call = stub.Generate(
        generation_pb2.GenerateRequest(**request), metadata=as_tenant(tenant), timeout=120
    )
    return (await collected(call))[2]


def stage_tokens(complete: generation_pb2.GenerationComplete, name: str) -> int:
    return sum(stage.tokens for stage in complete.timing.stages if stage.name == name)


async def ledger_row(ledger: Path, tenant: str) -> dict[str, int]:
    store = SqliteStore(ledger)
    try:
        rows = await store.usage()
    finally:
        await store.close()
    found = [counts for (who, _), counts in rows.items() if who == tenant]
    return found[0] if found else {}


def tenant_tokens(mesh: LlmMesh, tenant: str, kind: str) -> float:
    """aimesh_tenant_tokens_total of `tenant` and `kind` at the router, over its models."""
    url = mesh.metrics_url("generation")
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    pattern = (
        rf'^aimesh_tenant_tokens_total{{(?=[^}}]*kind="{kind}")(?=[^}}]*tenant="{tenant}")'
        rf"[^}}]*}} (\S+)$"
    )
    return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))


async def test_no_tenant_reuses_another_tenants_cached_prompt(tenancy_mesh):
    mesh, _ = tenancy_mesh
    stub, channel = mesh.stub()
    async with channel:
        request = {"prompt": SECRET, "stopping": stopping(1)}
        first = await generate(stub, "acme", **request)
        prompt_tokens = first.usage.prompt_tokens
        assert prompt_tokens > 64  # past prefill's first fixed cut: a hit can be used
        # globex sends acme's prompt: nothing of it is cached for globex, so its count and
        # its prefill's work (every prompt token computed) are those of a new prompt.
        probe = await generate(stub, "globex", **request)
        assert probe.usage.cached_tokens == 0
        assert stage_tokens(probe, "prefill") == prompt_tokens
        # acme itself reuses its own prefix, and so does globex now, in its own scope.
        again = await generate(stub, "acme", **request)
        assert again.usage.cached_tokens == cut_at_or_before(prompt_tokens - 1) > 0
        assert stage_tokens(again, "prefill") == prompt_tokens - again.usage.cached_tokens
        # A request's cache_salt narrows the scope further: a salt of its own is a miss.
        salted = await generate(stub, "acme", cache_salt="user-17", **request)
        assert salted.usage.cached_tokens == 0
        assert (await generate(stub, "acme", cache_salt="user-17", **request)).usage.cached_tokens
        too_long = stub.Generate(
            generation_pb2.GenerateRequest(cache_salt="s" * 257, **request), timeout=30
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collected(too_long)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cache_salt" in refused.value.details()


async def test_a_budget_is_charged_in_real_tokens_not_characters(tenancy_mesh):
    mesh, ledger = tenancy_mesh
    stub, channel = mesh.stub()
    async with channel:
        # 120 emoji are 30 "tokens" by characters / 4, and several times that in fact.
        emoji = stub.Generate(
            generation_pb2.GenerateRequest(prompt="😀" * 120, stopping=stopping(1)),
            metadata=as_tenant("tiny"),
            timeout=60,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collected(emoji)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_info(refused.value).reason == "INSUFFICIENT_QUOTA"
        assert retry_delay_s(refused.value) is None  # waiting cannot help
        needed = int(re.search(r"needs up to (\d+)", refused.value.details()).group(1))
        assert needed > 200
        # 50 empty messages are no free ride either: the chat template's tokens count.
        empty = [common_pb2.ChatMessage(role="user", content="")] * 50
        chat = stub.Chat(
            generation_pb2.ChatRequest(messages=empty, stopping=stopping(1)),
            metadata=as_tenant("tiny"),
            timeout=60,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collected(chat)
        assert error_info(refused.value).reason == "INSUFFICIENT_QUOTA"
        # Nothing was computed, so nothing was spent: a small request still fits.
        assert await ledger_row(ledger, "tiny") == {}
        served = await generate(stub, "tiny", prompt="Hi", stopping=stopping(3))
        assert served.usage.completion_tokens <= 3


async def test_concurrent_requests_never_overspend_a_budget(tenancy_mesh):
    mesh, ledger = tenancy_mesh
    stub, channel = mesh.stub()
    async with channel:
        request = {"prompt": "Count from one to fifty:", "stopping": stopping(40, ignore_eos=True)}
        results = await asyncio.gather(
            *(generate(stub, "burst", **request) for _ in range(10)), return_exceptions=True
        )
        served = [r for r in results if isinstance(r, generation_pb2.GenerationComplete)]
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert served and refused and len(served) + len(refused) == 10
        assert all(error_info(r).reason == "INSUFFICIENT_QUOTA" for r in refused)
        used = sum(r.usage.total_tokens for r in served)
        assert used <= 300
        await eventually(lambda: _total(ledger, "burst", used), timeout_s=30)


async def _total(ledger: Path, tenant: str, expected: int) -> bool:
    row = await ledger_row(ledger, tenant)
    return row.get("prompt_tokens", 0) + row.get("completion_tokens", 0) == expected


async def test_a_client_that_leaves_mid_stream_pays_for_every_token_it_caused(tenancy_mesh):
    mesh, ledger = tenancy_mesh
    stub, channel = mesh.stub()
    async with channel:
        prompt = "Write a long story about a lighthouse keeper."
        witness = await generate(stub, "witness", prompt=prompt, stopping=stopping(1))
        call = stub.Generate(
            generation_pb2.GenerateRequest(prompt=prompt, stopping=stopping(64, ignore_eos=True)),
            metadata=as_tenant("leaver"),
            timeout=120,
        )
        seen = 0
        async for message in call:
            seen += len(message.chunk.token_ids)
            if seen >= 5:
                break
        call.cancel()

        async def settled() -> bool:
            row = await ledger_row(ledger, "leaver")
            return row.get("prompt_tokens") == witness.usage.prompt_tokens

        await eventually(settled, timeout_s=30)
        row = await ledger_row(ledger, "leaver")
        assert row["requests"] == 1
        assert seen <= row["completion_tokens"] <= 64
        assert tenant_tokens(mesh, "leaver", "prompt") == row["prompt_tokens"]
        assert tenant_tokens(mesh, "leaver", "completion") == row["completion_tokens"]


async def test_a_client_that_leaves_before_its_first_token_pays_for_its_prompt(tenancy_mesh):
    mesh, ledger = tenancy_mesh
    queries = "aimesh_llm_prefix_cache_queries_total"
    prefill = mesh.metrics_url("prefill")
    stub, channel = mesh.stub()
    async with channel:
        prompt = " ".join(f"item {n} is blue;" for n in range(70))  # some 350 tokens
        before = metric_at(prefill, queries)
        call = stub.Generate(
            generation_pb2.GenerateRequest(prompt=prompt, stopping=stopping(8)),
            metadata=as_tenant("early"),
            timeout=120,
        )
        # Under way once prefill looked the prompt up; then the client goes, reading nothing.
        started = time.monotonic()
        while metric_at(prefill, queries) == before:
            assert time.monotonic() - started < 60, "prefill never saw the prompt"
            await asyncio.sleep(0.01)
        call.cancel()
        prompt_tokens = int(metric_at(prefill, queries) - before)

        async def settled() -> bool:
            return (await ledger_row(ledger, "early")).get("prompt_tokens") == prompt_tokens

        await eventually(settled, timeout_s=30)
        assert (await ledger_row(ledger, "early"))["completion_tokens"] <= 8


async def test_the_ledger_and_counters_equal_the_responses_usage(tenancy_mesh):
    mesh, ledger = tenancy_mesh
    stub, channel = mesh.stub()
    async with channel:
        completes = [
            await generate(stub, "books", prompt="The capital of France is", stopping=stopping(6)),
            await generate(
                stub,
                "books",
                prompt="Is the sky blue? Answer:",
                sampling={"choices": ["yes", "no"]},
            ),
        ]
        chat = stub.Chat(
            generation_pb2.ChatRequest(
                messages=[common_pb2.ChatMessage(role="user", content="Say hi.")],
                stopping=stopping(5),
            ),
            metadata=as_tenant("books"),
            timeout=120,
        )
        completes.append((await collected(chat))[2])
        prompt = sum(c.usage.prompt_tokens for c in completes)
        completion = sum(c.usage.completion_tokens for c in completes)

        async def recorded() -> bool:
            return (await ledger_row(ledger, "books")).get("requests") == 3

        await eventually(recorded, timeout_s=30)
        row = await ledger_row(ledger, "books")
        assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, completion)
        assert tenant_tokens(mesh, "books", "prompt") == prompt
        assert tenant_tokens(mesh, "books", "completion") == completion


async def test_one_tenants_limit_holds_back_no_other_tenant(tenancy_mesh):
    mesh, _ = tenancy_mesh
    stub, channel = mesh.stub()
    async with channel:
        # 60 tokens a minute: the first request reserves most of it, the second must wait.
        request = {"prompt": "Name a color:", "stopping": stopping(40)}
        await generate(stub, "paced", **request)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, "paced", **request)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_info(refused.value).reason == "RATE_LIMIT_EXCEEDED"
        assert retry_delay_s(refused.value) > 1
        # The same channel (its breaker honours a server's RetryInfo as backpressure) serves
        # another tenant at once: a tenant's limit is no sign the router is busy.
        other = await generate(stub, "books", **request)
        assert other.usage.completion_tokens > 0


async def test_a_tenant_with_token_limits_is_bounded_by_what_it_reserved(tenancy_mesh):
    mesh, _ = tenancy_mesh
    stub, channel = mesh.stub()
    async with channel:
        # No max_new_tokens, end of sequence ignored: only the reservation bounds it.
        capped = await generate(
            stub, "capped", prompt="Tell me about the sea.", stopping={"ignore_eos": True}
        )
        assert capped.usage.completion_tokens == RESERVE_TOKENS
