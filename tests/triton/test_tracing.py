"""One trace through Triton: the mesh's client span for a ModelInfer carries the caller's
trace to Triton in its traceparent header, and Triton's own spans (its OpenTelemetry mode,
exported over OTLP/HTTP to a real collector) join that trace under the client span."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from opentelemetry import trace

from loadtest.triton_server import TritonServer, prepare_repository, triton_venv
from mesh.config import MeshSettings
from mesh.triton import TritonModel, TritonSettings
from tests.conftest import free_port, spans_of, start_collector
from tests.triton.test_client import INPUTS

pytestmark = pytest.mark.system

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


# Triton's gRPC frontend reads the traceparent header as a C string, though gRPC's
# metadata values are not NUL-terminated (tritonserver's GrpcServerCarrier::Get calls
# strlen): when the bytes after the value are not a NUL, the header does not parse and
# that request starts a trace of its own (one in 30 to 50 here). Several calls, then, each
# under its own caller: the test fails only if none of them joins.
CALLS = 5


async def test_tritons_spans_join_the_callers_trace_under_the_client_span(traced_triton, spans):
    server, log = traced_triton
    model = TritonModel(TritonSettings(url=server.url, model=MODEL))
    joins: dict[str, str] = {}  # the client span's id -> its trace's id
    try:
        for _ in range(CALLS):
            spans.clear()
            with trace.get_tracer("tests").start_as_current_span("caller") as caller:
                await model.infer(INPUTS, [MODEL])
            (client,) = [
                span
                for span in spans.get_finished_spans()
                if span.name == "/inference.GRPCInferenceService/ModelInfer"
            ]
            assert client.kind == trace.SpanKind.CLIENT
            assert client.parent is not None
            assert client.parent.span_id == caller.get_span_context().span_id
            assert client.attributes["rpc.grpc.status_code"] == 0
            joins[format(client.context.span_id, "016x")] = format(
                caller.get_span_context().trace_id, "032x"
            )
    finally:
        await model.close()

    def joined(text: str) -> bool:
        return any(
            span["service"] == "triton" and span.get("Parent ID") == client_id
            for client_id, trace_id in joins.items()
            for span in spans_of(text, trace_id)
        )

    loop = asyncio.get_running_loop()
    # Triton batches its spans for 5 s before it exports them; the bound is generous.
    give_up = loop.time() + 60
    while not joined(await asyncio.to_thread(log.read_text)):
        assert loop.time() < give_up, (
            f"no span of Triton under any of the client spans {joins}\n"
            f"collector:\n{log.read_text()[-3000:]}\nTriton:\n{server.log.read_text()[-3000:]}"
        )
        await asyncio.sleep(0.5)
