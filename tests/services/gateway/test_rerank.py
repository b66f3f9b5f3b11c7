"""POST /v1/rerank in front of the real rerank service (minilm-late-interaction, in this
process): the Cohere/Jina shape LangChain and LlamaIndex send, answered with the same
order and scores as RerankService itself, usage in the tenant's ledger, and refusals
that name their parameter."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from services.rerank.servicer import SERVICE
from tests.harness import InProcess
from tests.services.gateway.conftest import KEYS, Gateway, start_gateway

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

QUERY = "how do I remove a folder and its contents?"
DOCUMENTS = [
    "heapq.heappush(heap, item): push item onto the heap.",
    "shutil.rmtree(path): recursively delete a directory tree.",
    "json.loads(s): deserialize a str containing a JSON document.",
]
MODEL = "minilm-late-interaction"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(
    tmp_path_factory,
) -> AsyncIterator[tuple[Gateway, rerank_pb2_grpc.RerankServiceStub]]:
    async with InProcess() as services:
        rerank = await services.start("rerank")
        gateway, servers = await start_gateway(
            tmp_path_factory.mktemp("keys"),
            keys={**KEYS, "sk-generate-only": ("writer", ["generate"])},
            dependencies={"rerank": rerank.target},
        )
        try:
            yield (
                gateway,
                rerank_pb2_grpc.RerankServiceStub(services.channel(rerank.target, SERVICE)),
            )
        finally:
            for server in servers:
                await server.drain(0)


async def test_strings_rank_as_the_rerank_service_ranks_them(mesh):
    gateway, stub = mesh
    async with gateway.http() as http:
        answer = await http.post(
            "/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS}
        )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    direct = await stub.Rerank(
        rerank_pb2.RerankRequest(
            query=QUERY, documents=[rerank_pb2.Document(text=t) for t in DOCUMENTS]
        )
    )
    assert [r["index"] for r in body["results"]] == [r.index for r in direct.results]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        [r.score for r in direct.results]
    )
    assert body["results"][0] == {
        "index": 1,
        "relevance_score": body["results"][0]["relevance_score"],
        "document": {"text": DOCUMENTS[1]},
    }
    assert body["model"] == MODEL and body["id"].startswith("rerank-")
    tokens = body["usage"]["total_tokens"]
    assert tokens == direct.usage.prompt_tokens > len(DOCUMENTS)


async def test_objects_top_n_and_no_documents(mesh):
    gateway, _ = mesh
    documents = [{"text": text, "title": f"doc {i}"} for i, text in enumerate(DOCUMENTS)]
    async with gateway.http() as http:
        answer = await http.post(
            "/v1/rerank",
            json={
                "model": MODEL,
                "query": "parse a JSON string",
                "documents": documents,
                "top_n": 1,
                "return_documents": False,
            },
        )
    assert answer.status_code == 200, answer.text
    assert [set(r) for r in answer.json()["results"]] == [{"index", "relevance_score"}]
    assert answer.json()["results"][0]["index"] == 2


async def test_a_document_longer_than_the_model_is_cut_not_refused(mesh):
    gateway, _ = mesh
    long = "the quick brown fox jumps over the lazy dog " * 400
    async with gateway.http() as http:
        answer = await http.post(
            "/v1/rerank", json={"model": MODEL, "query": "fox", "documents": [long, "cats"]}
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["results"][0]["index"] == 0


async def test_usage_reaches_the_tenants_ledger(mesh):
    gateway, _ = mesh
    async with gateway.http("sk-embed-only") as http:
        before = (await http.get("/v1/usage")).json()["data"]
        answer = await http.post(
            "/v1/rerank", json={"model": MODEL, "query": "heap", "documents": DOCUMENTS}
        )
        after = (await http.get("/v1/usage")).json()["data"]

    def prompt_tokens(rows: list[dict]) -> int:
        return sum(r["prompt_tokens"] for r in rows if r["model"] == MODEL)

    assert answer.status_code == 200, answer.text
    assert prompt_tokens(after) - prompt_tokens(before) == answer.json()["usage"]["total_tokens"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "query": "q", "documents": []}, 400, "documents"),
        ({"model": MODEL, "query": "", "documents": ["a"]}, 400, "query"),
        ({"model": MODEL, "query": "q", "documents": ["a", ""]}, 400, "documents[1].text"),
        ({"model": MODEL, "query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n"),
        ({"model": MODEL, "query": "q", "documents": [{"title": "x"}]}, 400, "documents[0]"),
        ({"model": MODEL, "query": "q", "documents": ["a"], "rank_fields": ["t"]}, 400,
         "rank_fields"),
        ({"model": "rerank-english-v3.0", "query": "q", "documents": ["a"]}, 404, "model"),
    ],
)  # fmt: skip
async def test_refusals_name_their_parameter(mesh, body, status, param):
    gateway, _ = mesh
    async with gateway.http() as http:
        answer = await http.post("/v1/rerank", json=body)
    assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), answer.text


async def test_a_key_without_the_embed_scope_is_forbidden(mesh):
    gateway, _ = mesh
    async with gateway.http("sk-generate-only") as http:
        answer = await http.post(
            "/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["a"]}
        )
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == "missing_scope"
