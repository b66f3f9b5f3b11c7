"""Runs by id: every event numbered and stored as it is sent, re-attached from any seq
(after a dropped stream, from another replica sharing the store), cancelled by id from
another call or replica, scoped to the client that started them, ended in a stated
terminal state."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from contextlib import aclosing
from types import SimpleNamespace

import pytest
from google.protobuf import json_format
from prometheus_client import REGISTRY

from aimesh.agent.v1 import agent_pb2
from aimesh.llm.v1 import generation_pb2
from mesh import caller
from mesh.failures import InvalidInput, NotFound
from services.agent import checkpoint, loop
from services.agent.planner import Observation, ToolStep
from services.agent.run_store import (
    SCHEMA_VERSION,
    Lease,
    LeaseLost,
    RunStore,
    SqliteRunStore,
    open_run_store,
)
from tests.conftest import eventually
from tests.services.agent.conftest import (
    FakeGeneration,
    FakeTools,
    failure,
    final,
    pending_tool_calls,
    result,
    run_all,
)

pytestmark = pytest.mark.service

ANSWERED, PARTIAL = agent_pb2.RUN_STATE_ANSWERED, agent_pb2.RUN_STATE_PARTIAL
FAILED, CANCELLED = agent_pb2.RUN_STATE_FAILED, agent_pb2.RUN_STATE_CANCELLED
HANDED_OFF = agent_pb2.RUN_STATE_HANDED_OFF


def as_client(name: str) -> None:
    """What the server interceptor does with the caller's metadata (mesh.caller)."""
    caller.adopt(SimpleNamespace(invocation_metadata=lambda: (("x-aimesh-client", name),)))


def slow(text: str, seconds: float):
    async def outcome(context):
        await asyncio.sleep(seconds)
        async for message in result(text)(context):
            yield message

    return outcome


async def attach(agent, run_id: str, after_seq: int = 0) -> list:
    request = agent_pb2.AttachRequest(run_id=run_id, after_seq=after_seq)
    async with aclosing(agent.Attach(request, None)) as events:
        return [event async for event in events]


# -- the store ---------------------------------------------------------------------------


LEASE = Lease("replica-a", 10.0)
OWNER = LEASE.owner


def create(store: RunStore, run_id: str, question: str = "q", client: str = "") -> None:
    store.create(agent_pb2.RunRequest(question=question), run_id, client, LEASE)


@pytest.fixture(params=["sqlite", "redis"])
def store_at(request, tmp_path) -> Callable[..., RunStore]:
    """Opens a run store of each kind: the SQLite file, and a real redis-server."""
    opened: list[RunStore] = []

    def open_store(retention_s: float = 86_400.0) -> RunStore:
        if request.param == "sqlite":
            store: RunStore = SqliteRunStore(tmp_path / "runs.sqlite3", retention_s)
        else:
            url = request.getfixturevalue("redis_url")
            store = open_run_store(url, tmp_path, retention_s)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """Both stores' wall clock, stopped at 1000 s (advance it by adding to [0])."""
    now = [1000.0]
    for module in ("run_store", "run_store_redis"):
        monkeypatch.setattr(f"services.agent.{module}.time.time", lambda: now[0])
    return now


def test_events_are_stored_and_read_back_by_their_client_only(store_at):
    store = store_at()
    create(store, "r1", "why?", client="alice")
    answer = "the same words again " * 200
    for seq, event in enumerate(
        [
            agent_pb2.RunResponse(answer_delta=agent_pb2.AnswerDelta(text=answer)),
            agent_pb2.RunResponse(final=agent_pb2.Final(state=ANSWERED)),
        ],
        start=1,
    ):
        event.run_id, event.seq = "r1", seq
        state = ANSWERED if seq == 2 else agent_pb2.RUN_STATE_RUNNING
        assert not store.append(event, state, owner=OWNER)
    assert store.get("r1", "bob") is None
    record = store.get("r1", "alice")
    assert (record.state, record.events, record.question) == (ANSWERED, 2, "why?")
    assert [e.seq for e in store.events("r1", 0)] == [1, 2]
    (later,) = store.events("r1", 1)
    assert later.final.state == ANSWERED


async def test_an_ended_run_expires_from_redis_after_the_retention_window(redis_url, tmp_path):
    store = open_run_store(redis_url, tmp_path, retention_s=1)
    create(store, "ended")
    store.append(agent_pb2.RunResponse(run_id="ended", seq=1), CANCELLED, owner=OWNER)
    create(store, "running")
    assert store.get("ended", "") is not None
    await eventually(lambda: store.get("ended", "") is None, timeout_s=10, interval_s=0.2)
    assert store.get("running", "") is not None
    store.close()


def test_events_are_stored_compressed(tmp_path):
    store = SqliteRunStore(tmp_path / "runs.sqlite3")
    create(store, "r1")
    answer = "the same words again " * 200
    event = agent_pb2.RunResponse(
        run_id="r1", seq=1, answer_delta=agent_pb2.AnswerDelta(text=answer)
    )
    store.append(event, owner=OWNER)
    store.close()
    with sqlite3.connect(tmp_path / "runs.sqlite3") as db:
        ((stored,),) = db.execute("SELECT length(body) FROM events WHERE seq = 1")
    assert stored < len(answer) / 10


def test_ended_runs_past_retention_are_pruned_and_running_ones_kept(tmp_path, monkeypatch):
    store = SqliteRunStore(tmp_path / "runs.sqlite3", retention_s=60)
    clock = [1000.0]
    monkeypatch.setattr("services.agent.run_store.time.time", lambda: clock[0])
    create(store, "ended")
    ended = agent_pb2.RunResponse(run_id="ended", seq=1, final=agent_pb2.Final(state=CANCELLED))
    store.append(ended, CANCELLED, owner=OWNER)
    create(store, "running")
    clock[0] += 61
    create(store, "new")
    assert store.get("ended", "") is None
    assert store.get("running", "") is not None
    store.close()


def test_a_run_whose_holder_stops_renewing_is_claimed_once(store_at, clock):
    store = store_at()
    request = agent_pb2.RunRequest(question="q", session_id="s")
    store.create(request, "kept", "alice", LEASE)
    store.create(request, "orphan", "alice", LEASE)
    clock[0] += 8
    assert store.renew(LEASE, ["kept"]) == ["kept"]  # replica-a renews what it still runs
    clock[0] += 5  # past the orphan's lease, within the renewed one
    other = Lease("replica-b", 10.0)
    (claimed,) = store.claim_orphans(other, limit=10)
    assert (claimed.run_id, claimed.client, claimed.request) == ("orphan", "alice", request)
    assert store.claim_orphans(Lease("replica-c", 10.0), limit=10) == []  # b holds it now
    assert store.renew(LEASE, ["orphan"]) == []  # the old holder, come back, holds it no more
    with pytest.raises(LeaseLost):  # nor may it write the run's events any more
        store.append(agent_pb2.RunResponse(run_id="orphan", seq=1), owner=OWNER)
    store.append(agent_pb2.RunResponse(run_id="orphan", seq=1), owner=other.owner)
    clock[0] += 11
    assert {o.run_id for o in store.claim_orphans(other, limit=10)} == {"kept", "orphan"}


def test_an_append_tried_again_is_stored_once(store_at):
    """A write whose reply was lost (the store went down after it) is tried again."""
    store = store_at()
    store.create(agent_pb2.RunRequest(question="q", session_id="s"), "r1", "", LEASE)
    delta = agent_pb2.RunResponse(run_id="r1", seq=1)
    delta.answer_delta.text = "once"
    for _ in range(2):
        store.append(delta, owner=OWNER)
    store.append(agent_pb2.RunResponse(run_id="r1", seq=2), ANSWERED, owner=OWNER)
    assert [e.seq for e in store.events("r1", 0)] == [1, 2]
    assert [t.answer for t in store.turns("", "s")] == ["once"]
    # Ended, it is still its replica's: a renewal racing its last event must not read
    # it as taken over.
    assert store.renew(LEASE, ["r1"]) == ["r1"]


def test_a_sessions_turns_are_read_a_page_after_another(store_at, clock):
    store = store_at()
    for n in range(9):
        clock[0] += 0 if n == 4 else 1  # r3 and r4 start together: by run id, then
        store.create(agent_pb2.RunRequest(question=f"q{n}", session_id="s"), f"r{n}", "a", LEASE)
        if n != 6:  # r6 still runs: no turn yet
            store.append(agent_pb2.RunResponse(run_id=f"r{n}", seq=1), ANSWERED, owner=OWNER)
    every = store.turns("a", "s")
    assert [t.run_id for t in every] == [f"r{n}" for n in range(9) if n != 6]
    paged, after = [], None
    while page := store.turns("a", "s", after, 2):
        assert len(page) <= 2
        paged += page
        after = page[-1].key
    assert paged == every
    assert store.turns("a", "s", every[-1].key, 2) == []


def test_sessions_cancels_and_the_handoff_queue_in_each_store(store_at):
    store = store_at()
    for n, question in enumerate(("first?", "second?", "running?")):
        store.create(
            agent_pb2.RunRequest(question=question, session_id="s"), f"r{n}", "alice", LEASE
        )
    for n in (0, 1):
        delta = agent_pb2.RunResponse(run_id=f"r{n}", seq=1)
        delta.answer_delta.text = f"answer {n}"
        store.append(delta, owner=OWNER)
        store.append(agent_pb2.RunResponse(run_id=f"r{n}", seq=2), ANSWERED, owner=OWNER)
    assert [(t.question, t.answer) for t in store.turns("alice", "s")] == [
        ("first?", "answer 0"),
        ("second?", "answer 1"),
    ]
    assert store.turns("bob", "s") == []
    store.request_cancel("r2")
    assert store.cancels_asked(["r0", "r1", "r2"]) == ["r2"]
    assert store.append(agent_pb2.RunResponse(run_id="r2", seq=1), owner=OWNER)  # heard
    assert store.delete_session("alice", "s") == 2  # the running one stays
    assert store.get("r2", "alice") is not None and store.turns("alice", "s") == []
    store.hand_off("r2", "alice", agent_pb2.RunRequest(question="running?"), ["why"])
    (queued,) = store.handoffs(10)
    assert (queued.run_id, queued.question, queued.notes) == ("r2", "running?", ["why"])
    assert store.take_handoff("r2") and not store.take_handoff("r2")


def test_a_checkpoint_round_trips_the_loops_state_compactly():
    state = loop.RunState(iterations=2, planner=loop.Planner.RULES, shortfalls=["tool_failed"])
    step = ToolStep("knowledge_search", {"query": "deep copy"}, "search")
    passages = [{"id": f"p{n}", "text": "copy.deepcopy copies " * 20} for n in range(5)]
    found = Observation(step, False, "5 passages", {"passages": passages}, call_id="1.1")
    state.observations.append(found)
    state.notes.append("calculator: failed")
    blob = checkpoint.dump(state)
    back = checkpoint.load(blob)
    assert (back.observations, back.iterations, back.notes) == (
        state.observations,
        2,
        ["calculator: failed"],
    )
    assert (back.planner, back.shortfalls) == (loop.Planner.RULES, ["tool_failed"])
    assert len(blob) < len(json.dumps(passages)) / 4


def test_a_store_written_by_a_newer_agent_is_refused(tmp_path):
    path = tmp_path / "runs.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match=f"schema {SCHEMA_VERSION + 1}"):
        SqliteRunStore(path)


# -- runs through the servicer -------------------------------------------------------------


async def test_every_event_carries_its_run_and_seq_and_attach_replays_them(start_agent):
    agent = await start_agent(FakeTools({"calculator": result("4")}), FakeGeneration())
    events = await run_all(agent, "What is 2+2?")
    run_id = events[0].run_id
    assert len(run_id) == 32 and {e.run_id for e in events} == {run_id}
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert final(events).state == ANSWERED
    assert await attach(agent, run_id) == events
    assert await attach(agent, run_id, after_seq=len(events) - 1) == events[-1:]
    got = await agent.GetRun(agent_pb2.GetRunRequest(run_id=run_id), None)
    assert (got.state, got.events, got.question) == (ANSWERED, len(events), "What is 2+2?")


async def test_a_background_run_outlives_its_stream_and_is_reattached_where_it_was(start_agent):
    tools = FakeTools({"calculator": slow("4", 0.5)})
    agent = await start_agent(tools, FakeGeneration())
    request = agent_pb2.RunRequest(
        question="What is 2+2?", options=agent_pb2.RunOptions(background=True)
    )
    seen = []
    async with aclosing(agent.Run(request, None)) as stream:
        async for event in stream:
            seen.append(event)
            if event.HasField("tool_call"):
                break  # the connection drops mid-run
    rest = await attach(agent, seen[-1].run_id, after_seq=seen[-1].seq)
    assert [e.seq for e in seen + rest] == list(range(1, len(seen) + len(rest) + 1))
    assert rest[0].HasField("tool_result") and not rest[0].tool_result.is_error
    assert final(rest).state == ANSWERED
    assert tools.calls == ["calculator"]


async def test_cancel_by_id_from_another_call_stops_the_run_and_its_tool_calls(start_agent):
    tools = FakeTools({"knowledge_search": "hang"})
    agent = await start_agent(tools, FakeGeneration())
    request = agent_pb2.RunRequest(question="How do I copy a list?")
    run = asyncio.create_task(run_all(agent, request.question))
    await asyncio.wait_for(tools.started.wait(), 10)
    (run_id,) = {r.run_id for r in agent.runs.live.values()}
    cancelled = await agent.Cancel(agent_pb2.CancelRequest(run_id=run_id), None)
    assert cancelled.state == CANCELLED
    events = await asyncio.wait_for(run, 10)
    assert final(events).state == CANCELLED
    await asyncio.wait_for(tools.cancelled.wait(), 10)
    assert pending_tool_calls() == []
    again = await agent.Cancel(agent_pb2.CancelRequest(run_id=run_id), None)
    assert again.state == CANCELLED


async def test_a_cancel_on_another_replica_stops_a_run_waiting_on_a_tool(start_agent):
    """Two agents on one store: the run's replica sees the other's Cancel while the tool
    it waits on sends nothing."""
    tools = FakeTools({"knowledge_search": "hang"})
    owner = await start_agent(tools, FakeGeneration())
    other = await start_agent(FakeTools({}), FakeGeneration())
    request = agent_pb2.RunRequest(
        question="How do I copy a list?", options=agent_pb2.RunOptions(background=True)
    )
    async with aclosing(owner.Run(request, None)) as stream:
        first = await anext(stream)
    await asyncio.wait_for(tools.started.wait(), 10)
    followed = asyncio.create_task(attach(other, first.run_id))
    cancelled = await other.Cancel(agent_pb2.CancelRequest(run_id=first.run_id), None)
    assert cancelled.state == CANCELLED
    events = await asyncio.wait_for(followed, 10)
    assert events[0] == first and final(events).state == CANCELLED
    await asyncio.wait_for(tools.cancelled.wait(), 10)


async def test_a_run_is_invisible_to_another_client(start_agent):
    agent = await start_agent(FakeTools({"calculator": result("4")}), FakeGeneration())
    as_client("alice")
    events = await run_all(agent, "What is 2+2?")
    as_client("mallory")
    run_id = events[0].run_id
    for call in (
        agent.GetRun(agent_pb2.GetRunRequest(run_id=run_id), None),
        agent.Cancel(agent_pb2.CancelRequest(run_id=run_id), None),
        attach(agent, run_id),
    ):
        with pytest.raises(NotFound):
            await call
    as_client("alice")
    assert (await agent.GetRun(agent_pb2.GetRunRequest(run_id=run_id), None)).state == ANSWERED


async def test_each_terminal_state_is_reached_and_stated(start_agent, tmp_path):
    tools = FakeTools({"calculator": failure, "knowledge_search": "hang"})
    agent = await start_agent(tools, FakeGeneration())
    partial = await run_all(agent, "What is 2+2?")
    assert final(partial).state == PARTIAL
    assert any("calculator" in note for note in final(partial).notes)
    # Refused once the tools are known: the caller gets INVALID_ARGUMENT, the run FAILED.
    with pytest.raises(InvalidInput):
        await run_all(agent, "What is 2+2?", allowed_tools=["no_such_tool"])
    with sqlite3.connect(tmp_path / "runs.sqlite3") as db:  # the fixture's store
        ((failed_id,),) = db.execute("SELECT run_id FROM runs WHERE state = ?", (FAILED,))
    replayed = await attach(agent, failed_id)
    assert final(replayed).state == FAILED and "no_such_tool" in final(replayed).notes[-1]
    # A caller that leaves a run not in the background ends it.
    request = agent_pb2.RunRequest(question="How do I copy a list?")
    async with aclosing(agent.Run(request, None)) as stream:
        left = await anext(stream)
        await asyncio.wait_for(tools.started.wait(), 10)
    got = await agent.GetRun(agent_pb2.GetRunRequest(run_id=left.run_id), None)
    assert got.state == CANCELLED


@pytest.mark.parametrize("run_id", ["", "x" * 32, "A" * 32, "0" * 31, "0" * 33, "é" * 16])
async def test_a_malformed_run_id_is_refused_naming_the_field(start_agent, run_id):
    agent = await start_agent(FakeTools({}), FakeGeneration())
    with pytest.raises(InvalidInput) as refused:
        await agent.GetRun(agent_pb2.GetRunRequest(run_id=run_id), None)
    assert [v.field for v in refused.value.violations] == ["run_id"]


# -- sessions ----------------------------------------------------------------------------


async def ask_in(agent, session_id: str, question: str) -> list:
    request = agent_pb2.RunRequest(question=question, session_id=session_id)
    return [event async for event in agent.Run(request, None)]


async def test_a_sessions_next_question_is_asked_after_its_earlier_turns(start_agent):
    generation = FakeGeneration(answer="json.loads returns a Python object.")
    agent = await start_agent(FakeTools({"python_doc": result("doc")}), generation)
    first = await ask_in(agent, "s-1", "What does json.loads return?")
    generation.answer = "It does the opposite."
    await ask_in(agent, "s-1", "And json.dumps?")
    earlier = generation.answer_prompts[-1][1:-1]
    assert earlier == [
        {"role": "user", "content": "What does json.loads return?"},
        {"role": "assistant", "content": "json.loads returns a Python object."},
    ]
    assert "And json.dumps?" in generation.answer_prompts[-1][-1]["content"]
    # Another session, and another client's same session id, start from nothing.
    await ask_in(agent, "s-2", "What does json.loads return?")
    assert len(generation.answer_prompts[-1]) == 2
    as_client("mallory")
    await ask_in(agent, "s-1", "What did I ask?")
    assert len(generation.answer_prompts[-1]) == 2
    got = await agent.GetSession(agent_pb2.GetSessionRequest(session_id="s-1"), None)
    assert [t.question for t in got.turns] == ["What did I ask?"]
    as_client("")
    got = await agent.GetSession(agent_pb2.GetSessionRequest(session_id="s-1"), None)
    assert (got.turns[0].run_id, got.turns[0].state) == (first[0].run_id, ANSWERED)
    assert [t.answer for t in got.turns] == [
        "json.loads returns a Python object.",
        "It does the opposite.",
    ]
    deleted = await agent.DeleteSession(agent_pb2.DeleteSessionRequest(session_id="s-1"), None)
    assert deleted.deleted_runs == 2
    got = await agent.GetSession(agent_pb2.GetSessionRequest(session_id="s-1"), None)
    assert list(got.turns) == []


async def test_a_sessions_earlier_turns_are_in_the_planning_conversation(start_agent):
    tools = FakeTools({"calculator": result("391")})
    generation = FakeGeneration(answer="17 * 23 = 391.")
    agent = await start_agent(tools, generation)
    await ask_in(agent, "s", "What is 17 * 23?")
    generation.plans = [[("calculator", {"expression": "391 + 100"})]]
    events = await ask_in(agent, "s", "Add 100 to that.")
    planning = generation.plan_requests[-2]  # the second run's first round
    assert [(m.role, m.content) for m in planning.messages[-3:]] == [
        ("user", "What is 17 * 23?"),
        ("assistant", "17 * 23 = 391."),
        ("user", "Add 100 to that."),
    ]
    assert planning.tool_choice.mode == generation_pb2.ToolChoice.MODE_AUTO
    assert planning.parallel_tool_calls
    (call,) = [e.tool_call for e in events if e.HasField("tool_call")]
    assert json_format.MessageToDict(call.arguments) == {"expression": "391 + 100"}
    assert final(events).planner == agent_pb2.PLANNER_LLM


async def test_the_oldest_turns_that_do_not_fit_are_left_out_and_said(start_agent):
    generation = FakeGeneration(answer="a" * 40)
    agent = await start_agent(FakeTools({"calculator": result("4")}), generation, history_chars=110)
    for n in range(3):
        await ask_in(agent, "s", f"What is {n}+{n}?")  # 12 + 40 characters each
    events = await ask_in(agent, "s", "What is 9+9?")
    earlier = generation.answer_prompts[-1][1:-1]
    assert [m["content"] for m in earlier if m["role"] == "user"] == [
        "What is 1+1?",
        "What is 2+2?",
    ]
    assert any("1 earlier turn(s)" in note for note in final(events).notes)


@pytest.mark.parametrize("session_id", ["a b", "x" * 129, "é", "a/b"])
async def test_a_malformed_session_id_is_refused_naming_the_field(start_agent, session_id):
    agent = await start_agent(FakeTools({}), FakeGeneration())
    with pytest.raises(InvalidInput) as refused:
        await ask_in(agent, session_id, "What is 2+2?")
    assert [v.field for v in refused.value.violations] == ["session_id"]
    with pytest.raises(InvalidInput):
        await agent.GetSession(agent_pb2.GetSessionRequest(session_id=session_id), None)


# -- hand-offs, tiers, counts ------------------------------------------------------------


def runs_counted(state: str, reason: str) -> float:
    value = REGISTRY.get_sample_value("aimesh_agent_runs_total", {"state": state, "reason": reason})
    return value or 0.0


@pytest.mark.parametrize(
    ("outcomes", "options", "reason"),
    [
        # The lookup fails and the search it leads to is one iteration too many.
        ({"python_doc": failure, "knowledge_search": result("found")}, {"max_iterations": 1},
         "max_iterations"),
        # The lookup fails, then the search fails too.
        ({"python_doc": failure, "knowledge_search": failure}, {}, "tool_failures"),
    ],
)  # fmt: skip
async def test_a_run_with_nothing_to_answer_from_goes_to_a_person(
    start_agent, outcomes, options, reason
):
    lookup = [("python_doc", {"name": "json.loads"})]
    agent = await start_agent(FakeTools(outcomes), FakeGeneration([lookup]))
    before = runs_counted("handed_off", reason)
    events = await run_all(agent, "What does json.loads return?", **options)
    assert final(events).state == HANDED_OFF
    assert not [e for e in events if e.HasField("answer_delta")]  # no guess
    assert any("handed off to a person" in note for note in final(events).notes)
    (queued,) = await asyncio.to_thread(agent.runs.store.handoffs, 10)
    assert (queued.run_id, queued.question) == (events[0].run_id, "What does json.loads return?")
    assert runs_counted("handed_off", reason) == before + 1
    assert await asyncio.to_thread(agent.runs.store.take_handoff, queued.run_id)
    assert await asyncio.to_thread(agent.runs.store.handoffs, 10) == []


async def test_one_failing_round_still_answers_partially_and_is_counted(start_agent):
    agent = await start_agent(FakeTools({"calculator": failure}), FakeGeneration())
    before = runs_counted("partial", "tool_failed")
    events = await run_all(agent, "What is 2+2?")
    assert final(events).state == PARTIAL
    assert runs_counted("partial", "tool_failed") == before + 1


async def test_the_plan_and_the_answer_go_to_the_models_configured_for_them(start_agent):
    generation = FakeGeneration([[("calculator", {"expression": "2+2"})]])
    agent = await start_agent(
        FakeTools({"calculator": result("4")}),
        generation,
        plan_model="small-planner",
        answer_model="chat",
    )
    await run_all(agent, "What is 2+2?")
    # Two rounds of planning (the call, then the model stops), then the answer.
    assert generation.models == [("plan", "small-planner")] * 2 + [("answer", "chat")]
