"""Property: whatever a caller sends, retrieval answers with the caller's status (OK,
INVALID_ARGUMENT naming a field, NOT_FOUND), never INTERNAL or UNKNOWN or a hang.

Requests go over real gRPC to a retrieval server in this process, on embedded Qdrant in a
temporary folder, with the fake embedder (conftest.FakeEmbedder) at the embedder's boundary.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aimesh.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings
from mesh.errors import field_violations
from services.retrieval.servicer import SERVICE
from tests.strategies import wild_strings as wild_strings_of

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="module")]

ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
PROPERTY = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Requests are drawn sane (valid-looking, so they reach Qdrant, filters and payloads
# included), then a few of their parts made wild: strings with non-ASCII, names that mean
# something here and runs of one character up to 300 KB; numbers with NaN, infinities and
# extremes; payloads nested past any limit.
texts = st.text(max_size=24)
wild_strings = wild_strings_of(
    ["", " ", "docs", "dense", "nope", "é", "_aimesh_text", "json"],
    [65, 257, 9000, 70_000, 300_000],
    short=texts,
)
sane_keys = st.sampled_from(["m", "n", "a.b", "a[]", "a[0]", 'x."y z"[3]', "meta.source", "é"])
wild_keys = st.one_of(
    st.sampled_from(
        ["a..b", "[]", "a[-1]", "a[", "a.", "$", "a b", '"_aimesh_id"', "_aimesh_text", ""]
    ),
    wild_strings,
)
finite = st.floats(allow_nan=False, allow_infinity=False)
doubles = st.floats()
collections = st.sampled_from(["docs", "dense"])


def _rarely(draw: st.DrawFn) -> bool:
    return draw(st.integers(0, 7)) == 0


@st.composite
def conditions(
    draw: st.DrawFn, keys: st.SearchStrategy[str], numbers: st.SearchStrategy[float]
) -> retrieval_pb2.Condition:
    condition = retrieval_pb2.Condition(key=draw(keys))
    match = draw(st.sampled_from(["keyword", "integer", "boolean", "range"]))
    if match == "keyword":
        condition.keyword = draw(texts)
    elif match == "integer":
        condition.integer = draw(st.integers(-(2**63), 2**63 - 1))
    elif match == "boolean":
        condition.boolean = draw(st.booleans())
    elif match == "range":
        condition.range.SetInParent()
        for bound in draw(st.sets(st.sampled_from(["gt", "gte", "lt", "lte"]), min_size=1)):
            setattr(condition.range, bound, draw(numbers))
    return condition


sane_searches = st.builds(
    retrieval_pb2.SearchRequest,
    collection=collections,
    query=st.text(min_size=1, max_size=40),
    top_k=st.one_of(st.none(), st.integers(1, 100)),
    filter=st.builds(
        retrieval_pb2.Filter,
        must=st.lists(conditions(sane_keys, finite), max_size=2),
        should=st.lists(conditions(sane_keys, finite), max_size=2),
        must_not=st.lists(conditions(sane_keys, finite), max_size=2),
    ),
    score_threshold=st.one_of(st.none(), st.floats(-2, 2, width=32)),
    mode=st.integers(0, 3),
    with_payload=st.booleans(),
)


@st.composite
def wild_filters(draw: st.DrawFn) -> retrieval_pb2.Filter:
    """A sane filter with one condition's key or match made wild, or far too many."""
    if _rarely(draw):
        many = draw(st.sampled_from([65, 1000]))
        return retrieval_pb2.Filter(should=[retrieval_pb2.Condition(key="m", boolean=True)] * many)
    group = draw(st.lists(conditions(sane_keys, finite), min_size=1, max_size=3))
    condition = group[draw(st.integers(0, len(group) - 1))]
    part = draw(st.sampled_from(["key", "key", "keyword", "range", "no match"]))
    if part == "key":
        condition.key = draw(wild_keys)
    elif part == "keyword":
        condition.keyword = draw(wild_strings)
    elif part == "range":
        condition.range.lt = draw(doubles)
    else:
        condition.ClearField("match")
    return retrieval_pb2.Filter(**{draw(st.sampled_from(["must", "should", "must_not"])): group})


wild_search_fields = {
    "request_id": wild_strings,
    "collection": wild_strings,
    "query": wild_strings,
    "top_k": st.integers(-(2**31), 2**31 - 1),
    "score_threshold": st.floats(width=32),
    "mode": st.integers(0, 6),
}


@st.composite
def searches(draw: st.DrawFn) -> retrieval_pb2.SearchRequest:
    """A sane search with each field made wild now and then (the filter, which has the
    most to check, every other time), so that a wild value mostly meets otherwise valid
    requests and gets past their checks to the store."""
    request = draw(sane_searches)
    if draw(st.booleans()):
        request.filter.CopyFrom(draw(wild_filters()))
    for name, wild in wild_search_fields.items():
        if _rarely(draw):
            setattr(request, name, draw(wild))
    return request


def _json(numbers: st.SearchStrategy[float], strings: st.SearchStrategy[str]) -> st.SearchStrategy:
    return st.recursive(
        st.none() | st.booleans() | numbers | strings,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
        max_leaves=12,
    )


def _nest(struct: struct_pb2.Struct, depth: int) -> None:
    """Nests {"k": ...} `depth` objects deep in place; protobuf will not copy one past ~30."""
    for _ in range(depth - 1):
        struct = struct.get_or_create_struct("k")
    struct["x"] = math.nan


# A document as (id, text, payload): a JSON object, or how deep to nest one.
sane_documents = st.tuples(
    texts,
    st.text(min_size=1, max_size=200),
    st.dictionaries(texts, _json(finite, texts), max_size=4),
)
wild_payloads = st.one_of(
    st.dictionaries(wild_strings, _json(doubles, wild_strings), max_size=4), st.integers(1, 60)
)


@st.composite
def wild_documents(draw: st.DrawFn) -> tuple[str, str, dict | int]:
    """A sane document with one part made wild."""
    parts = list(draw(sane_documents))
    part = draw(st.integers(0, 2))
    parts[part] = draw(wild_payloads if part == 2 else wild_strings)
    return tuple(parts)


@st.composite
def upsert_streams(draw: st.DrawFn) -> list[retrieval_pb2.UpsertRequest]:
    """Mostly sane messages, a few of their documents, collections or ids made wild."""
    collection = draw(collections)
    messages = []
    for index in range(draw(st.integers(0 if _rarely(draw) else 1, 3))):
        if _rarely(draw):
            name = draw(wild_strings)
        elif index:
            name = draw(st.sampled_from([collection, ""]))  # later messages may leave it out
        else:
            name = collection
        message = retrieval_pb2.UpsertRequest(
            request_id=draw(wild_strings) if _rarely(draw) else "", collection=name
        )
        if _rarely(draw):
            parts = [("", "t", {})] * 257
        else:
            documents = st.one_of(sane_documents, wild_documents())
            parts = draw(st.lists(documents, min_size=0 if _rarely(draw) else 1, max_size=4))
        for doc_id, text, payload in parts:
            # Built in place: adding a finished Document copies it, which a deep one fails.
            document = message.documents.add(id=doc_id, text=text)
            if isinstance(payload, int):
                _nest(document.payload, payload)
            else:
                document.payload.update(payload)
        messages.append(message)
    return messages


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(fake_retrieval) -> AsyncIterator[grpc.aio.Channel]:
    async with create_channel(
        f"127.0.0.1:{fake_retrieval.port}", MeshSettings(), services=[SERVICE]
    ) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        for collection, sparse in (("docs", True), ("dense", False)):
            await stub.CreateCollection(
                retrieval_pb2.CreateCollectionRequest(collection=collection, sparse_enabled=sparse)
            )
            # Documents for filters to test: Qdrant reads no filter over an empty collection.
            seed = retrieval_pb2.UpsertRequest(collection=collection)
            for i in range(3):
                document = seed.documents.add(id=f"seed.{i}", text=f"seed document {i}")
                document.payload.update({"m": "json", "n": i, "a": {"b": [i, "x"]}})
            await stub.Upsert(iter([seed]))
        yield channel


async def _status(call: grpc.aio.Call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        event(error.code().name)  # --hypothesis-show-statistics: how often each answer came
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert field_violations(error), "a refusal must name the field"
        return error.code()
    event("OK")
    return grpc.StatusCode.OK


@settings(PROPERTY, max_examples=300)
@given(request=searches())
async def test_searches_get_the_callers_answer(channel, request):
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
    assert await _status(stub.Search(request, timeout=30)) in ANSWERS


@settings(PROPERTY, max_examples=150)
@given(stream=upsert_streams())
async def test_upserts_get_the_callers_answer(channel, stream):
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)

    async def messages() -> AsyncIterator[retrieval_pb2.UpsertRequest]:
        for message in stream:
            yield message

    assert await _status(stub.Upsert(messages(), timeout=30)) in ANSWERS


@settings(PROPERTY, max_examples=200)
@given(data=st.binary(max_size=64), method=st.sampled_from(["Search", "Upsert", "Delete"]))
async def test_arbitrary_bytes_get_the_callers_answer(channel, data, method):
    """Bytes as they come, whatever protobuf makes of them."""
    path = f"/aimesh.retrieval.v1.RetrievalService/{method}"
    if method == "Upsert":

        async def messages() -> AsyncIterator[bytes]:
            yield data

        call = channel.stream_unary(path)(messages(), timeout=30)
    else:
        call = channel.unary_unary(path)(data, timeout=30)
    assert await _status(call) in ANSWERS
