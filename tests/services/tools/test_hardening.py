"""The tools service against hostile or unlucky calls: every bad request is
INVALID_ARGUMENT naming its field (never INTERNAL, UNKNOWN or a hang), idempotency keys are
scoped per client and bounded, the event loop never evaluates arithmetic, and
knowledge_search passes on retrieval's note when rerank is down.

Most tests call the servicer in process; those that need the wire or health start a bare
tools server whose backends are closed ports or small fakes.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from aimesh.tools.v1 import tools_pb2
from mesh import caller
from mesh.client import ChannelPool, create_channel
from mesh.config import MeshSettings
from mesh.errors import field_violations, status_for_failure
from mesh.failures import AlreadyExists, Failure, InvalidInput
from services.tools import builtin
from services.tools.builtin import BUILTIN
from services.tools.idempotency import IdempotencyKeys
from services.tools.schema import MAX_DEPTH
from services.tools.servicer import ToolsServicer
from services.tools.settings import ToolsSettings
from services.tools.tool import ToolContext, ToolDefinition, ToolOutput
from tests.conftest import free_port

pytestmark = pytest.mark.service


class FakeContext:
    """What the server interceptor reads from a grpc.aio.ServicerContext: the metadata."""

    def __init__(self, client: str | None = None) -> None:
        self.metadata = () if client is None else ((caller.METADATA_KEY, client),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


def servicer_with(*tools: ToolDefinition, **settings: Any) -> tuple[ToolsServicer, ChannelPool]:
    """An in-process servicer whose wrapped services are closed ports, and its channels."""
    dead = f"127.0.0.1:{free_port()}"
    channels = ChannelPool(MeshSettings())
    context = ToolContext(ToolsSettings(**settings), lambda _, service: channels.get(dead, service))
    return ToolsServicer(context, tools or BUILTIN), channels


@pytest_asyncio.fixture
async def servicer() -> AsyncIterator[ToolsServicer]:
    servicer, channels = servicer_with()
    yield servicer
    await channels.close()


def call(tool: str, key: str = "", **arguments: Any) -> tools_pb2.CallToolRequest:
    request = tools_pb2.CallToolRequest(name=tool, idempotency_key=key)
    request.arguments.update(arguments)
    return request


async def result_of(
    servicer: ToolsServicer, request: tools_pb2.CallToolRequest, client: str | None = None
) -> tools_pb2.CallToolResult:
    context = FakeContext(client)
    caller.adopt(context)  # as the server interceptor does
    messages = [m async for m in servicer.CallTool(request, context)]
    assert messages[-1].HasField("result")
    return messages[-1].result


async def refusal(servicer: ToolsServicer, request: tools_pb2.CallToolRequest) -> list[str]:
    """The fields an InvalidInput names, each description checked to be short."""
    with pytest.raises(InvalidInput) as caught:
        await result_of(servicer, request)
    assert all(len(v.description) <= 200 for v in caught.value.violations)
    return [v.field for v in caught.value.violations]


async def over_the_wire(stub, request: tools_pb2.CallToolRequest) -> tools_pb2.CallToolResult:
    messages = [m async for m in stub.CallTool(request)]
    return messages[-1].result


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"expression": "1"}
    for _ in range(depth):
        value = {"a": value}
    return value


HUGE = "x" * 300_000
BAD_CALLS = {
    "NaN argument": (call("calculator", expression=math.nan), ["arguments.expression"]),
    "infinite argument": (call("calculator", expression=-math.inf), ["arguments.expression"]),
    "NaN in a list": (call("calculator", expression="1", a=[[1, math.nan]]), ["arguments.a[0][1]"]),
    "nested 60 deep": (call("calculator", **nested(60)), ["arguments" + ".a" * MAX_DEPTH]),
    "a 300 KB name": (call(HUGE, expression="1"), ["name"]),
    "a non-ASCII name": (call("calculatör", expression="1"), ["name"]),
    "a 300 KB key": (call("calculator", HUGE, expression="1"), ["idempotency_key"]),
    "a 300 KB argument": (call("calculator", expression=HUGE), ["arguments"]),
    "a 20 KB argument": (call("calculator", expression="1" * 20_000), ["arguments.expression"]),
}  # fmt: skip


@pytest.mark.parametrize(("request_", "fields"), BAD_CALLS.values(), ids=BAD_CALLS.keys())
async def test_malformed_calls_are_invalid_argument_naming_the_field(servicer, request_, fields):
    assert await refusal(servicer, request_) == fields


@pytest.mark.parametrize("cursor", ["²", "٣", "1²", "0" * 300_000, " 1", "-0"])
async def test_a_cursor_that_is_not_ascii_digits_is_invalid_argument(servicer, cursor):
    with pytest.raises(InvalidInput) as caught:
        await servicer.ListTools(tools_pb2.ListToolsRequest(cursor=cursor), FakeContext())
    assert [v.field for v in caught.value.violations] == ["cursor"]


async def test_unparsable_requests_on_the_wire_are_invalid_argument(bare_tools):
    """grpc answers bytes its parser refuses with UNKNOWN unless the service parses them."""
    mesh = await bare_tools()
    deep = call("calculator", **nested(60)).SerializeToString()
    not_utf8 = b"\x12\x02\xff\xfe"  # field 2 (name), two bytes that are not UTF-8
    async with create_channel(f"127.0.0.1:{mesh.tools.port}", MeshSettings()) as channel:
        raw = channel.unary_stream("/aimesh.tools.v1.ToolsService/CallTool")
        for data, field in [(deep, "arguments"), (not_utf8, "name"), (b"\xff\xff", "request")]:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [m async for m in raw(data)]
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [v.field for v in field_violations(caught.value)] == [field]
        list_tools = channel.unary_unary("/aimesh.tools.v1.ToolsService/ListTools")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await list_tools(b"\x0a\x01\xff")  # field 1 (cursor), not UTF-8
        assert [v.field for v in field_violations(caught.value)] == ["cursor"]
    # A refusal quoting a huge name would not fit in trailing metadata either.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [m async for m in mesh.stub.CallTool(call(HUGE))]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- idempotency keys ----


async def test_idempotency_keys_are_scoped_per_client(servicer):
    first = await result_of(servicer, call("calculator", "k", expression="1+1"), client="alice")
    assert not first.is_error
    # Bob's "k" is his own: neither alice's result nor a clash with her arguments.
    bob = await result_of(servicer, call("calculator", "k", expression="2+2"), client="bob")
    assert json_format.MessageToDict(bob.structured_content)["value"] == 4
    inside = await result_of(servicer, call("calculator", "k", expression="3+3"))
    assert json_format.MessageToDict(inside.structured_content)["value"] == 6
    with pytest.raises(AlreadyExists):
        await result_of(servicer, call("calculator", "k", expression="5+5"), client="alice")
    again = await result_of(servicer, call("calculator", "k", expression="1+1"), client="alice")
    assert again == first


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


OK = tools_pb2.CallToolResult(content=[tools_pb2.Content(text="done")])


async def test_the_key_store_is_bounded_and_forgets_the_oldest_first():
    keys = IdempotencyKeys(window_s=600, max_entries=3)
    for n in range(5):
        entry, runs = keys.claim("c", f"k{n}", "call")
        assert runs
        keys.settle(entry, OK)
    assert len(keys) == 3
    assert keys.claim("c", "k4", "call")[1] is False  # the newest still replays
    assert keys.claim("c", "k0", "call")[1] is True  # the oldest was forgotten


async def test_keys_expire_in_claim_order_and_a_retried_key_starts_its_window_again():
    clock = Clock()
    keys = IdempotencyKeys(window_s=600, max_entries=100, clock=clock)
    a, _ = keys.claim("c", "a", "call")
    clock.now = 1
    keys.settle(keys.claim("c", "b", "call")[0], OK)
    clock.now = 2
    keys.settle(a, None)  # failed: the next call with "a" runs, from now
    keys.claim("c", "a", "call")
    clock.now = 601.5  # past b's window, inside a's new one
    assert keys.claim("c", "a", "call")[1] is False
    assert len(keys) == 1


async def test_an_evicted_running_call_still_answers_its_waiters():
    keys = IdempotencyKeys(window_s=600, max_entries=1)
    running, _ = keys.claim("c", "slow", "call")
    waiting, runs = keys.claim("c", "slow", "call")
    assert waiting is running and not runs
    keys.claim("c", "other", "call")  # evicts "slow" while it runs
    keys.settle(running, OK)
    assert waiting.result.result() == OK


def gated_tool(gate: asyncio.Event, runs: list[int]) -> ToolDefinition:
    """A tool that finishes when the test opens `gate`, counting its runs."""

    async def body(arguments: dict[str, Any], context: ToolContext) -> AsyncIterator[Any]:
        runs.append(1)
        await gate.wait()
        yield ToolOutput("done", {"runs": len(runs)})

    schema = {"type": "object"}
    return ToolDefinition(
        "gated", "Gated", "waits", schema, None, tools_pb2.ToolAnnotations(), body, 30, 30
    )


async def test_a_cancelled_duplicate_does_not_cancel_the_others():
    gate, runs = asyncio.Event(), []
    servicer, channels = servicer_with(gated_tool(gate, runs))
    first = asyncio.ensure_future(result_of(servicer, call("gated", "once")))
    await asyncio.sleep(0.05)
    waiters = [asyncio.ensure_future(result_of(servicer, call("gated", "once"))) for _ in range(2)]
    await asyncio.sleep(0.05)
    waiters[0].cancel()
    gate.set()
    assert (await waiters[1]) == (await first) and len(runs) == 1
    assert waiters[0].cancelled()
    await channels.close()


# ---- the calculator off the event loop ----


async def test_health_answers_while_an_expression_is_evaluated(bare_tools, monkeypatch):
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow_calculate(expression: str) -> int:
        started.set()
        release.wait(timeout=3)
        finished.set()
        return 1

    monkeypatch.setattr(builtin, "calculate", slow_calculate)
    mesh = await bare_tools()
    running = asyncio.ensure_future(over_the_wire(mesh.stub, call("calculator", expression="1")))
    try:
        assert await asyncio.to_thread(started.wait, 10)
        async with create_channel(f"127.0.0.1:{mesh.tools.port}", MeshSettings()) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="tools")
            answer = await health.Check(request, timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert not finished.is_set()  # health answered while the expression was running
    finally:
        release.set()
        await running


# ---- knowledge_search passes on retrieval's note ----


class FakeRetrieval(retrieval_pb2_grpc.RetrievalServiceServicer):
    """Answers as retrieval does when rerank is down: retrieval order and a note."""

    def __init__(self) -> None:
        self.requests: list[retrieval_pb2.SearchRequest] = []

    async def Search(self, request, context):
        self.requests.append(request)
        hits = [retrieval_pb2.Hit(id=f"p{n}", text=f"passage {n}") for n in range(request.top_k)]
        return retrieval_pb2.SearchResponse(
            hits=hits, note="reranking unavailable (UNAVAILABLE): hits are in retrieval order"
        )


async def test_knowledge_search_asks_retrieval_to_rerank_and_passes_on_its_note(
    bare_tools, start_fake
):
    fake = FakeRetrieval()
    retrieval = await start_fake(retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server, fake)
    mesh = await bare_tools(dependencies={"retrieval": retrieval})
    result = await over_the_wire(mesh.stub, call("knowledge_search", query="copy a list", top_k=3))
    assert not result.is_error
    (request,) = fake.requests
    assert request.rerank and request.top_k == 3  # the candidate depth is retrieval's
    found = json_format.MessageToDict(result.structured_content)
    assert [p["id"] for p in found["passages"]] == ["p0", "p1", "p2"]
    assert found["note"].startswith("reranking unavailable (UNAVAILABLE)")
    assert result.content[0].text.startswith("reranking unavailable")

    result = await over_the_wire(
        mesh.stub, call("knowledge_search", query="copy a list", top_k=2, rerank=False)
    )
    assert not fake.requests[-1].rerank and fake.requests[-1].top_k == 2


# ---- any request at all ----

LEAVES = (
    st.none()
    | st.booleans()
    | st.floats()
    | st.sampled_from([math.nan, math.inf, -math.inf])
    | st.text(max_size=20)
)
JSON = st.recursive(
    LEAVES | st.sampled_from([70_000, 300_000]).map(lambda n: "é" * n),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
NUMBERS = st.integers(-(10**6), 10**6).map(str) | st.sampled_from(["9", "0", ".5", "1e308", "pi"])
ARITHMETIC = st.recursive(
    NUMBERS,
    lambda inner: (
        st.builds("({}){}({})".format, inner, st.sampled_from("+-*/%^"), inner)
        | st.builds(
            "{}({})".format, st.sampled_from(["sqrt", "log", "exp", "round", "floor"]), inner
        )
    ),
    max_leaves=8,
)
EXPRESSIONS = ARITHMETIC | st.text(alphabet="0123456789+-*/%^()., episqrtlogmaxround", max_size=300)
DEEP = st.integers(0, 80).map(nested)
JUNK_ARGUMENTS = DEEP | st.dictionaries(st.text(max_size=12), JSON, max_size=4)
CALLS = (
    st.tuples(st.just("calculator"), st.builds(lambda e: {"expression": e}, EXPRESSIONS))
    | st.tuples(st.sampled_from([tool.name for tool in BUILTIN]), JUNK_ARGUMENTS)
    | st.tuples(
        st.sampled_from(["", "calculatör"]) | st.text() | st.just(300_000).map(lambda n: "x" * n),
        JUNK_ARGUMENTS,
    )
)
KEYS = st.sampled_from(["", "k", "k2", "é" * 100]) | st.text(max_size=140)
CURSORS = st.sampled_from(["", "0", "1", "4", "²", "٣", "0" * 50, "-1"]) | st.text(max_size=12)
BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(CALLS, KEYS, st.sampled_from([None, "a", "b"]), CURSORS)
async def test_no_request_is_answered_as_a_server_bug(servicer, tool_call, key, client, cursor):
    name, arguments = tool_call
    request = tools_pb2.CallToolRequest(name=name, idempotency_key=key)
    request.arguments.update(arguments)
    try:
        result = await result_of(servicer, request, client)
        event(f"{name[:20]}: {'is_error' if result.is_error else 'ok'}")
    except Failure as failure:
        event(f"{status_for_failure(failure).code.name}")
        assert status_for_failure(failure).code not in BUGS
    try:
        await servicer.ListTools(tools_pb2.ListToolsRequest(cursor=cursor), FakeContext())
    except Failure as failure:
        assert status_for_failure(failure).code not in BUGS
