"""Rerank with its transformer on a real Triton server: the same scores as in process, the
RPC's deadline and cancellation reach the passes on Triton, and Triton's outages surface
as the mesh's own UNAVAILABLE, open breaker and readiness."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
import tritonclient.grpc.aio as triton_aio

from aimesh.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from loadtest.triton_server import ADMIN_HEADER
from mesh.errors import error_info
from mesh.health import probe, wait_until_serving
from services.rerank.scorers import Scorer
from services.rerank.servicer import load_scorer
from services.rerank.settings import RerankSettings
from tests.conftest import VENV_BIN, free_port, subprocess_env
from tests.triton.conftest import until

pytestmark = pytest.mark.system

MODEL = "token_embedding"
BREAKER_CALLS = 4
PARAGRAPH = (
    "shutil.copytree copies a whole directory tree, and shutil.rmtree deletes one, "
    "following the options given for symlinks and errors. "
)
# ~1500 tokens: cut to the documents' 128, and over the model's 512 with any query.
LONG = " ".join(f"Paragraph {n}: {PARAGRAPH}" for n in range(40))
DOCUMENTS = [
    "heapq.heappush(heap, item): push item onto the heap.",
    "shutil.rmtree(path): recursively delete a directory tree.",
    "json.loads(s): deserialize a str containing a JSON document.",
    "naïve café, Grüße aus München, 日本語のテキスト 🙂",
    "x",
    LONG,
    *(f"Passage {n} about topic {n % 7}: " + "more words about it " * (n % 11) for n in range(40)),
]  # 46 documents, lengths 3 to 128 tokens: the documents take several passes
QUERIES = [
    "how do I remove a folder and its contents?",
    "parse a JSON string",
    "topic 3",
    "copy " * 300,  # a long query, cut at 512 tokens
]
# Outlasts its deadline many times over: 1000 documents cut to 128 tokens are 63 passes,
# minutes of one Triton CPU thread (2-3 s a pass on 2 busy cores).
SLOW = [PARAGRAPH * 6] * 1000
QUIET_S = 5  # longer than a pass takes here


@pytest.fixture(scope="module")
def in_process() -> Scorer:
    return load_scorer(RerankSettings())


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def rerank(triton, tmp_path_factory) -> AsyncIterator[str]:
    """`aimesh serve rerank` whose transformer runs on Triton; a small breaker window."""
    await triton.wait_ready(MODEL)  # another module's test may have just restarted Triton
    port = free_port()
    log = tmp_path_factory.mktemp("rerank") / "rerank.log"
    process = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "aimesh"), "serve", "rerank",
        env=subprocess_env(
            AIMESH_SERVICES__RERANK__PORT=str(port),
            AIMESH_SERVICES__RERANK__METRICS_PORT="0",
            AIMESH_SERVICES__RERANK__BACKEND="triton",
            AIMESH_SERVICES__RERANK__TRITON__URL=triton.url,
            AIMESH_SERVICES__RERANK__TRITON__MODEL=MODEL,
            AIMESH_CLIENT__BREAKER__WINDOW_SIZE=str(BREAKER_CALLS),
            AIMESH_CLIENT__BREAKER__MINIMUM_CALLS=str(BREAKER_CALLS),
            AIMESH_CLIENT__BREAKER__OPEN_WAIT_S="1",
        ),
        stderr=log.open("wb"),
    )  # fmt: skip
    target = f"127.0.0.1:{port}"
    try:
        assert await wait_until_serving(target, "rerank", timeout_s=120), log.read_text()[-3000:]
        yield target
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def rerank_call(
    target: str, query: str, documents: list[str], timeout_s: float = 60
) -> rerank_pb2.RerankResponse:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = rerank_pb2_grpc.RerankServiceStub(channel)
        return await stub.Rerank(
            rerank_pb2.RerankRequest(
                query=query,
                documents=[rerank_pb2.Document(id=str(i), text=t) for i, t in enumerate(documents)],
                truncate=True,
                raw_scores=True,
            ),
            timeout=timeout_s,
        )


async def test_scores_through_triton_equal_the_in_process_ones(rerank, in_process):
    for query in QUERIES:
        reply = await rerank_call(rerank, query, DOCUMENTS)
        assert reply.model == "minilm-late-interaction"
        served = {r.index: r.score for r in reply.results}
        local = in_process.score(query, DOCUMENTS)
        assert sorted(served) == list(range(len(DOCUMENTS)))
        differences = [abs(served[i] - score) for i, score in enumerate(local)]
        assert max(differences) < 1e-4, (query[:40], max(differences))


async def passes_run(triton) -> int:
    """How many requests Triton's token_embedding has executed since it started (its
    statistics answer the test server's admin key only)."""
    async with triton_aio.InferenceServerClient(triton.url) as client:
        stats = await client.get_inference_statistics(
            MODEL, headers={ADMIN_HEADER: triton.admin_key}, as_json=True
        )
    return int(stats["model_stats"][0]["execution_count"])


@pytest.mark.parametrize("ending", ["deadline", "cancel"])
async def test_a_request_that_ends_early_sends_triton_no_more_passes(rerank, triton, ending):
    await rerank_call(rerank, "warm", ["up"])
    before = await passes_run(triton)
    started = time.monotonic()
    if ending == "deadline":
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rerank_call(rerank, "copy a directory", SLOW, timeout_s=4)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        call = asyncio.create_task(rerank_call(rerank, "copy a directory", SLOW))
        await asyncio.sleep(4)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
    assert time.monotonic() - started < 10
    # Triton has run the slow request's passes up to its end, and at most the one in
    # flight then; the next request queues behind that one at most.
    reply = await rerank_call(rerank, "delete a folder", DOCUMENTS[:3], timeout_s=20)
    assert reply.results[0].index == 1
    # Triton counts an execution just after sending its response: let the last one land.
    await asyncio.sleep(1)
    run = await passes_run(triton)
    assert 1 <= run - before - 2 < 40, "some of the slow request's 64 passes ran, not all"
    await asyncio.sleep(QUIET_S)
    assert await passes_run(triton) == run, "no pass of the ended request runs after it"


async def test_triton_down_is_unavailable_at_once_opens_the_breaker_and_recovers(rerank, triton):
    await rerank_call(rerank, "warm", ["up"])
    triton.stop()
    reasons = []
    for _ in range(BREAKER_CALLS + 1):
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await rerank_call(rerank, "while Triton is down", DOCUMENTS[:2])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5, "promptly, not after a timeout"
        reasons.append(error_info(caught.value).reason)
    assert reasons[0] == "TRITON_UNAVAILABLE"
    assert reasons[-1] == "CIRCUIT_OPEN"

    async def not_ready() -> bool:
        return await probe(rerank, "rerank") == "NOT_SERVING"

    await until(not_ready, timeout_s=10)
    assert await probe(rerank, "") == "SERVING", "alive all along"

    triton.start()
    await triton.wait_all_ready()
    assert await wait_until_serving(rerank, "rerank", timeout_s=30)

    async def serves() -> bool:
        try:
            reply = await rerank_call(rerank, "delete a folder", DOCUMENTS)
        except grpc.aio.AioRpcError:
            return False
        return reply.results[0].index == 1

    await until(serves, timeout_s=15)
