"""The agent's runs on disk: each run's record and every event it sent, so a client can
re-attach to a run by id (on any replica that shares the store), Cancel reaches a run
whichever replica runs it, and a run whose replica died is taken over by another (a
lease its holder renews; services/agent/runs.py).

Embedded default: SQLite (stdlib), one file, WAL so readers do not wait on the writer.
Every event is stored as it is sent, a RunResponse in protobuf (the schema'd form the
client receives) compressed with zlib; the schema's version is the file's user_version.
A run's record holds its client (every read is scoped by it), session, state, question,
the answer so far, event count and whether a Cancel asked it to stop. Runs handed to a
person wait in the handoff queue (a table here) until someone takes them. A session is its
client's runs under one session id: its turns are their questions and answers. Ended
runs are pruned after `retention_s` (and with them old turns), so the file is bounded by
traffic over that window.

Only the replica that holds a run's lease writes its events: `append` names the holder
and is refused (LeaseLost) once another replica has claimed the run, so a replica that
lost its lease while the store did not answer cannot add to a run that goes on
elsewhere. An append is idempotent by its seq (one tried again after a failure that may
have come after the write is not stored twice).

Calls are blocking (sqlite3); the servicer runs them in a worker thread. What they raise
when the store itself fails (locked past busy_timeout, disk full, I/O error: sqlite3's
OperationalError; the Redis store's connection errors) is each store's `FAILURES`: a
fault of the store, worth trying again, not of the request.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aimesh.agent.v1 import agent_pb2

SCHEMA_VERSION = 1
RUNNING = agent_pb2.RUN_STATE_RUNNING
ANSWERED_STATES = (agent_pb2.RUN_STATE_ANSWERED, agent_pb2.RUN_STATE_PARTIAL)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    client TEXT NOT NULL,
    question TEXT NOT NULL,
    state INTEGER NOT NULL,
    events INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    session_id TEXT NOT NULL DEFAULT '',
    answer TEXT NOT NULL DEFAULT '',
    -- What resuming it on another replica needs: the RunRequest (protobuf), the loop's
    -- state after its last step (services/agent/checkpoint.py), and who holds it until when.
    request BLOB NOT NULL,
    checkpoint BLOB,
    owner TEXT NOT NULL,
    lease_until REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_by_lease ON runs (state, lease_until);
CREATE INDEX IF NOT EXISTS runs_by_update ON runs (state, updated_at);
CREATE INDEX IF NOT EXISTS runs_by_session ON runs (client, session_id, created_at);
-- The handoff queue: runs given to a person, oldest first, until one marks them done.
CREATE TABLE IF NOT EXISTS handoffs (
    run_id TEXT PRIMARY KEY,
    client TEXT NOT NULL,
    question TEXT NOT NULL,
    notes TEXT NOT NULL,
    created_at REAL NOT NULL
);
-- Each replica's last renewal: written every renewal, runs or not, so that a replica
-- with nothing running still finds out that the store cannot be written.
CREATE TABLE IF NOT EXISTS replicas (
    owner TEXT PRIMARY KEY,
    seen_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (run_id, seq)
);
"""


class LeaseLost(Exception):
    """The run is held by another replica now (its lease ran out here and was claimed)."""


@dataclass(frozen=True)
class Lease:
    """Who holds a run (a replica's id) and for how long each renewal is good."""

    owner: str
    seconds: float


@dataclass(frozen=True)
class Orphan:
    """A run whose replica died, as the replica that takes it over finds it."""

    run_id: str
    client: str
    request: agent_pb2.RunRequest
    checkpoint: bytes | None
    answer: str  # what it had sent of its answer
    events: int


@dataclass(frozen=True)
class Handoff:
    run_id: str
    client: str
    question: str
    notes: list[str]
    created_at: float


@dataclass(frozen=True)
class Turn:
    run_id: str
    question: str
    answer: str
    state: int
    created_at: float

    @property
    def key(self) -> TurnKey:
        return TurnKey(self.created_at, self.run_id)


@dataclass(frozen=True, order=True)
class TurnKey:
    """Where a turn stands in its session's order (when its run started, then its id):
    where a page of turns ends and the next begins."""

    created_at: float
    run_id: str


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    client: str
    question: str
    state: int  # agent_pb2.RunState
    events: int
    cancel_requested: bool
    created_at: float
    updated_at: float

    @property
    def ended(self) -> bool:
        return self.state != RUNNING


class RunStore(Protocol):
    """Where runs live: SqliteRunStore on one machine, RedisRunStore
    (services/agent/run_store_redis.py) for replicas on several. Blocking calls."""

    # What its calls raise when the store fails (not the request): worth trying again.
    FAILURES: tuple[type[Exception], ...]

    def create(
        self, request: agent_pb2.RunRequest, run_id: str, client: str, lease: Lease
    ) -> None: ...
    def append(
        self,
        event: agent_pb2.RunResponse,
        state: int = RUNNING,
        checkpoint: bytes | None = None,
        *,
        owner: str,
    ) -> bool: ...
    def renew(self, lease: Lease, run_ids: list[str]) -> list[str]: ...
    def claim_orphans(self, lease: Lease, limit: int) -> list[Orphan]: ...
    def hand_off(
        self, run_id: str, client: str, request: agent_pb2.RunRequest, notes: list[str]
    ) -> None: ...
    def handoffs(self, limit: int) -> list[Handoff]: ...
    def take_handoff(self, run_id: str) -> bool: ...
    def cancels_asked(self, run_ids: list[str]) -> list[str]: ...
    def request_cancel(self, run_id: str) -> None: ...
    def get(self, run_id: str, client: str) -> RunRecord | None: ...
    def turns(
        self,
        client: str,
        session_id: str,
        after: TurnKey | None = None,
        limit: int | None = None,
    ) -> list[Turn]: ...
    def delete_session(self, client: str, session_id: str) -> int: ...
    def events(
        self, run_id: str, after_seq: int, limit: int = 256
    ) -> list[agent_pb2.RunResponse]: ...
    def close(self) -> None: ...


class SqliteRunStore:
    """The embedded store: one SQLite file, for one machine's replicas."""

    FAILURES = (sqlite3.OperationalError,)

    def __init__(self, path: Path, retention_s: float = 86_400.0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.retention_s = retention_s
        # One connection, used from worker threads one call at a time.
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{path} holds run store schema {version}; this agent reads up to "
                    f"{SCHEMA_VERSION}"
                )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create(self, request: agent_pb2.RunRequest, run_id: str, client: str, lease: Lease) -> None:
        """A new run, RUNNING, held by `lease`; ended runs past the retention window go."""
        now = time.time()
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._prune(now)
            self._db.execute(
                "INSERT INTO runs (run_id, client, question, state, created_at, updated_at,"
                " session_id, request, owner, lease_until) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    client,
                    request.question,
                    RUNNING,
                    now,
                    now,
                    request.session_id,
                    request.SerializeToString(),
                    lease.owner,
                    now + lease.seconds,
                ),
            )

    def append(
        self,
        event: agent_pb2.RunResponse,
        state: int = RUNNING,
        checkpoint: bytes | None = None,
        *,
        owner: str,
    ) -> bool:
        """Stores the event (its run_id and seq set), the loop's state after it when
        given, and with a terminal `state` ends the run, if `owner` holds the run
        (LeaseLost if not); an event of that seq stored already is not stored again.
        True when a Cancel has asked the run to stop."""
        body = zlib.compress(event.SerializeToString())
        text = event.answer_delta.text if event.HasField("answer_delta") else ""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            held = self._db.execute(
                "SELECT owner, events, cancel_requested FROM runs WHERE run_id = ?",
                (event.run_id,),
            ).fetchone()
            if held is None or held[0] != owner:
                raise LeaseLost(f"run {event.run_id} is not held by {owner}")
            if held[1] >= event.seq:
                return bool(held[2])
            self._db.execute(
                "INSERT INTO events (run_id, seq, body) VALUES (?, ?, ?)",
                (event.run_id, event.seq, body),
            )
            row = self._db.execute(
                "UPDATE runs SET events = ?, state = ?, updated_at = ?, answer = answer || ?,"
                " checkpoint = coalesce(?, checkpoint) WHERE run_id = ? RETURNING cancel_requested",
                (event.seq, state, time.time(), text, checkpoint, event.run_id),
            ).fetchone()
        return bool(row and row[0])

    def renew(self, lease: Lease, run_ids: list[str]) -> list[str]:
        """Extends the lease on those of these runs that `lease.owner` still holds;
        which those are (its runs that ended too: a run whose last event was just stored
        is not another replica's). Records the replica's renewal either way (a write,
        also with no runs). Replicas gone past the retention window go."""
        now = time.time()
        marks = ", ".join("?" * len(run_ids))
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT INTO replicas (owner, seen_at) VALUES (?, ?)"
                " ON CONFLICT (owner) DO UPDATE SET seen_at = excluded.seen_at",
                (lease.owner, now),
            )
            self._db.execute("DELETE FROM replicas WHERE seen_at < ?", (now - self.retention_s,))
            rows = self._db.execute(
                f"UPDATE runs SET lease_until = ? WHERE owner = ? AND run_id IN ({marks})"
                " RETURNING run_id",
                (now + lease.seconds, lease.owner, *run_ids),
            ).fetchall()
        return [run_id for (run_id,) in rows]

    def claim_orphans(self, lease: Lease, limit: int) -> list[Orphan]:
        """Takes over running runs whose holder stopped renewing (a replica that died):
        each is `lease.owner`'s now, with what resuming it needs."""
        now = time.time()
        orphaned = "SELECT 1 FROM runs WHERE state = ? AND lease_until < ? LIMIT 1"
        with self._lock:
            if self._db.execute(orphaned, (RUNNING, now)).fetchone() is None:
                return []  # the common case, without taking the write lock
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            rows = self._db.execute(
                "SELECT run_id, client, request, checkpoint, answer, events FROM runs"
                " WHERE state = ? AND lease_until < ? LIMIT ?",
                (RUNNING, now, limit),
            ).fetchall()
            for run_id, *_ in rows:
                self._db.execute(
                    "UPDATE runs SET owner = ?, lease_until = ? WHERE run_id = ?",
                    (lease.owner, now + lease.seconds, run_id),
                )
        return [
            Orphan(run_id, client, agent_pb2.RunRequest.FromString(request), checkpoint, answer, n)
            for run_id, client, request, checkpoint, answer, n in rows
        ]

    def request_cancel(self, run_id: str) -> None:
        with self._lock, self._db:
            self._db.execute(
                "UPDATE runs SET cancel_requested = 1 WHERE run_id = ? AND state = ?",
                (run_id, RUNNING),
            )

    def hand_off(
        self, run_id: str, client: str, request: agent_pb2.RunRequest, notes: list[str]
    ) -> None:
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO handoffs (run_id, client, question, notes, created_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (run_id, client, request.question, json.dumps(notes), time.time()),
            )

    def handoffs(self, limit: int) -> list[Handoff]:
        """The queue, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT run_id, client, question, notes, created_at FROM handoffs"
                " ORDER BY created_at LIMIT ?",
                (limit,),
            ).fetchall()
        return [Handoff(r, c, q, json.loads(n), t) for r, c, q, n, t in rows]

    def take_handoff(self, run_id: str) -> bool:
        """A person took the run: it leaves the queue. False when it was not there."""
        with self._lock, self._db:
            return (
                self._db.execute("DELETE FROM handoffs WHERE run_id = ?", (run_id,)).rowcount == 1
            )

    def cancels_asked(self, run_ids: list[str]) -> list[str]:
        """Which of these running runs a Cancel asked to stop."""
        if not run_ids:
            return []
        marks = ", ".join("?" * len(run_ids))
        with self._lock:
            rows = self._db.execute(
                f"SELECT run_id FROM runs WHERE cancel_requested = 1 AND run_id IN ({marks})",
                run_ids,
            ).fetchall()
        return [run_id for (run_id,) in rows]

    def get(self, run_id: str, client: str) -> RunRecord | None:
        """The run, if it exists and belongs to `client`."""
        with self._lock:
            row = self._db.execute(
                "SELECT run_id, client, question, state, events, cancel_requested, created_at,"
                " updated_at FROM runs WHERE run_id = ? AND client = ?",
                (run_id, client),
            ).fetchone()
        return None if row is None else RunRecord(*row[:5], bool(row[5]), *row[6:])

    def turns(
        self,
        client: str,
        session_id: str,
        after: TurnKey | None = None,
        limit: int | None = None,
    ) -> list[Turn]:
        """The session's answered (or partly answered) runs, oldest first: those after
        `after` (all: None), at most `limit` (None: all)."""
        start = after or TurnKey(float("-inf"), "")
        with self._lock:
            rows = self._db.execute(
                "SELECT run_id, question, answer, state, created_at FROM runs"
                " WHERE client = ? AND session_id = ? AND state IN (?, ?)"
                " AND (created_at > ? OR (created_at = ? AND run_id > ?))"
                " ORDER BY created_at, run_id LIMIT ?",
                (
                    client,
                    session_id,
                    *ANSWERED_STATES,
                    start.created_at,
                    start.created_at,
                    start.run_id,
                    -1 if limit is None else limit,
                ),
            ).fetchall()
        return [Turn(*row) for row in rows]

    def delete_session(self, client: str, session_id: str) -> int:
        """Forgets the session's ended runs; how many."""
        runs = "SELECT run_id FROM runs WHERE client = ? AND session_id = ? AND state != ?"
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                f"DELETE FROM events WHERE run_id IN ({runs})", (client, session_id, RUNNING)
            )
            deleted = self._db.execute(
                "DELETE FROM runs WHERE client = ? AND session_id = ? AND state != ?",
                (client, session_id, RUNNING),
            ).rowcount
        return deleted

    def events(self, run_id: str, after_seq: int, limit: int = 256) -> list[agent_pb2.RunResponse]:
        with self._lock:
            rows = self._db.execute(
                "SELECT body FROM events WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (run_id, after_seq, limit),
            ).fetchall()
        return [agent_pb2.RunResponse.FromString(zlib.decompress(body)) for (body,) in rows]

    def _prune(self, now: float) -> None:
        horizon = now - self.retention_s
        old = "SELECT run_id FROM runs WHERE state != ? AND updated_at < ?"
        self._db.execute(f"DELETE FROM events WHERE run_id IN ({old})", (RUNNING, horizon))
        self._db.execute("DELETE FROM runs WHERE state != ? AND updated_at < ?", (RUNNING, horizon))


def open_run_store(setting: str, cache_dir: Path, retention_s: float) -> RunStore:
    """`[services.agent] run_store`: "" (<cache_dir>/agent-runs.sqlite3), a file path, or
    a Redis URL that replicas on several machines share."""
    if setting.startswith(("redis://", "rediss://", "unix://")):
        from services.agent.run_store_redis import RedisRunStore  # it imports this module

        return RedisRunStore(setting, retention_s)
    path = Path(setting) if setting else cache_dir / "agent-runs.sqlite3"
    return SqliteRunStore(path, retention_s)
