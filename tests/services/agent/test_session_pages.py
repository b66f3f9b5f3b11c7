"""GetSession a page at a time (services/agent/session_pages.py), over real loopback gRPC:
a 400-turn session is read whole by a client with gRPC's default 4 MiB receive limit,
every turn once and in order; pages are bounded by count and by bytes (one turn past the
page's bytes comes cut, and says so); `aimesh runs session` pages through it; bad paging
input is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from aimesh.agent.v1 import agent_pb2, agent_pb2_grpc
from mesh.config import MeshSettings
from mesh.errors import field_violations
from services.agent import servicer
from services.agent.cli import session_turns
from services.agent.run_store import Lease, SqliteRunStore
from services.agent.session_pages import DEFAULT_PAGE_TURNS, MAX_PAGE_BYTES, MAX_PAGE_TURNS
from services.agent.settings import AgentSettings
from tests.conftest import subprocess_env
from tests.harness import InProcess

pytestmark = pytest.mark.service

SESSION = "long"
LEASE = Lease("writer", 10.0)
# gRPC's default receive limit: what a client that sets none gets.
DEFAULT_RECEIVE_BYTES = 4 * 1024 * 1024


def _answered(store: SqliteRunStore, n: int, question: str, answer: str) -> str:
    run_id = f"{n:032x}"
    store.create(agent_pb2.RunRequest(question=question, session_id=SESSION), run_id, "", LEASE)
    delta = agent_pb2.RunResponse(run_id=run_id, seq=1)
    delta.answer_delta.text = answer
    store.append(delta, owner=LEASE.owner)
    store.append(agent_pb2.RunResponse(run_id=run_id, seq=2), agent_pb2.RUN_STATE_ANSWERED,
                 owner=LEASE.owner)  # fmt: skip
    return run_id


@pytest_asyncio.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """An agent on a run store of its own, in this process on a loopback port; its
    address and the store's file, to fill."""
    path = tmp_path / "runs.sqlite3"

    async def setup(server):
        agent = servicer.serve_agent(server, AgentSettings(run_store=str(path)))
        add = agent_pb2_grpc.add_AgentServiceServicer_to_server
        server.add_service(add, agent, servicer.SERVICE)
        return agent

    async with InProcess() as services:
        served = await services.start("agent", MeshSettings(), setup=setup)
        yield served.target, path


async def test_a_400_turn_session_is_read_whole_within_the_default_receive_limit(agent):
    target, path = agent
    store = SqliteRunStore(path)
    # Questions at their 8 KiB bound and long answers: 400 turns are ~5 MiB.
    run_ids = [
        _answered(store, n, f"q{n} " + "x" * 8000, f"a{n} " + "y" * 5000) for n in range(400)
    ]
    store.close()
    pages = []
    async with grpc.aio.insecure_channel(target) as channel:  # a client that sets no limit
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        request = agent_pb2.GetSessionRequest(session_id=SESSION, page_size=MAX_PAGE_TURNS)
        while True:
            got = await stub.GetSession(request, timeout=30)
            pages.append(got)
            if not got.next_page_token:
                break
            request.page_token = got.next_page_token
        turns = [turn async for turn in session_turns(stub, SESSION)]
    assert [t.run_id for t in turns] == run_ids  # every turn once, oldest first
    assert [t.run_id for page in pages for t in page.turns] == run_ids
    assert all(
        page.ByteSize() < min(DEFAULT_RECEIVE_BYTES, MAX_PAGE_BYTES + 1024) for page in pages
    )
    assert len(pages) == 5  # 80 turns each: bounded by bytes, not only by count
    assert not any(t.answer_truncated for t in turns)
    assert turns[7].answer == "a7 " + "y" * 5000


async def test_a_page_is_bounded_by_its_size_and_a_turn_too_large_comes_cut(agent):
    target, path = agent
    store = SqliteRunStore(path)
    for n in range(DEFAULT_PAGE_TURNS + 5):
        _answered(store, n, f"q{n}", f"a{n}")
    _answered(store, 99, "the long one", "z" * (3 * MAX_PAGE_BYTES))
    store.close()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        first = await stub.GetSession(agent_pb2.GetSessionRequest(session_id=SESSION), timeout=30)
        assert len(first.turns) == DEFAULT_PAGE_TURNS  # page_size 0: the default
        second = await stub.GetSession(
            agent_pb2.GetSessionRequest(session_id=SESSION, page_token=first.next_page_token),
            timeout=30,
        )
        # The long turn does not fit after the five short ones: it starts the next page.
        assert [t.question for t in second.turns] == [
            f"q{n}" for n in range(DEFAULT_PAGE_TURNS, DEFAULT_PAGE_TURNS + 5)
        ]
        third = await stub.GetSession(
            agent_pb2.GetSessionRequest(session_id=SESSION, page_token=second.next_page_token),
            timeout=30,
        )
    assert not third.next_page_token
    (cut,) = third.turns
    assert cut.question == "the long one" and cut.answer_truncated
    assert 0 < len(cut.answer) < MAX_PAGE_BYTES and set(cut.answer) == {"z"}
    assert third.ByteSize() <= MAX_PAGE_BYTES


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"page_size": MAX_PAGE_TURNS + 1}, "page_size"),
        ({"page_size": -1}, "page_size"),
        ({"page_token": "not a token"}, "page_token"),
        ({"page_token": "W10="}, "page_token"),  # base64 of [], well formed, no place
        ({"page_token": "x" * 10_000}, "page_token"),
    ],
)
async def test_bad_paging_is_refused_naming_the_field(agent, fields, field):
    target, _ = agent
    async with grpc.aio.insecure_channel(target) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetSession(
                agent_pb2.GetSessionRequest(session_id=SESSION, **fields), timeout=10
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(refused.value)] == [field]


async def test_aimesh_runs_session_lists_every_turn_of_a_long_session(agent):
    target, path = agent
    store = SqliteRunStore(path)
    run_ids = [_answered(store, n, f"q{n}", "y" * 20_000) for n in range(120)]
    store.close()
    listed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "mesh.cli", "runs", "session", SESSION, "--json"],
        env=subprocess_env(
            AIMESH_SERVICES__AGENT__PORT=target.rsplit(":", 1)[1], OTEL_TRACES_EXPORTER="none"
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    turns = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [t["runId"] for t in turns] == run_ids
