"""One trace through Triton: the mesh's client span for a ModelInfer carries the caller's
trace to Triton in its traceparent header, and Triton's own spans (its OpenTelemetry mode,
exported over OTLP/HTTP to a real collector) join that trace under the client span."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
from opentelemetry import trace

from loadtest.triton_server import TritonServer, prepare_repository, triton_venv
from mesh.config import MeshSettings
from mesh.triton import TritonModel, TritonSettings
from tests.conftest import free_port, spans_of, start_collector
from tests.triton.test_client import INPUTS

MODEL = "sentence_embedding"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def traced_triton(tmp_path_factory) -> AsyncIterator[tuple[TritonServer, Path]]:
    """A Triton of its own (one model: seconds to start) tracing every request."""
    work = tmp_path_factory.mktemp("triton-traced")
    log = work / "spans.log"
    http_port = free_port()
    collector, _ = await start_collector(log, http_port)
    repository = await asyncio.to_thread(
        prepare_repository, work / "models", MeshSettings().cache_dir, [MODEL]
    )
    server = TritonServer(
        await asyncio.to_thread(triton_venv),
        repository,
        work,
        free_port(),
        otlp_traces_url=f"http://127.0.0.1:{http_port}/v1/traces",
    )
    server.start()
    try:
        await server.wait_ready(MODEL)
        yield server, log
    finally:
        server.stop()
        collector.terminate()
        await collector.wait()


async def test_tritons_spans_join_the_callers_trace_under_the_client_span(traced_triton, spans):
    server, log = traced_triton
    model = TritonModel(TritonSettings(url=server.url, model=MODEL))
    try:
        with trace.get_tracer("tests").start_as_current_span("caller") as caller:
            await model.infer(INPUTS, [MODEL])
    finally:
        await model.close()
    (client,) = [
        span
        for span in spans.get_finished_spans()
        if span.name == "/inference.GRPCInferenceService/ModelInfer"
    ]
    assert client.kind == trace.SpanKind.CLIENT
    assert client.parent is not None
    assert client.parent.span_id == caller.get_span_context().span_id
    assert client.attributes["triton.model"] == MODEL
    assert client.attributes["rpc.grpc.status_code"] == 0

    trace_id = format(caller.get_span_context().trace_id, "032x")
    client_id = format(client.context.span_id, "016x")
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 30
    while not any(
        span["service"] == "triton" and span.get("Parent ID") == client_id
        for span in spans_of(await asyncio.to_thread(log.read_text), trace_id)
    ):
        assert loop.time() < give_up, f"no span of Triton under {client_id} in trace {trace_id}"
        await asyncio.sleep(0.5)
