"""The run store on Redis, for agent replicas on several machines (run it with
appendonly, so runs outlive a Redis restart): the same records, events, leases, sessions
and handoff queue as the SQLite store (services/agent/run_store.py), under
`aimesh:agent:`.

Keys: `run:<id>` a hash (the record, the request, the checkpoint), `run:<id>:events` a
list of compressed events (seq n at index n - 1), `leases` a sorted set of running runs
by lease expiry, `session:<client>:<id>` a sorted set of run ids by start, `handoffs` a
sorted set and `handoff:<id>` hashes, `replica:<owner>` each replica's last renewal
(expiring). A run that ends expires after the retention window
(its session's entry is dropped when found gone). Steps that must not interleave (an
event and its record, a lease taken over) are Lua scripts, atomic in Redis.
"""

from __future__ import annotations

import json
import time
import zlib

import redis

from aimesh.agent.v1 import agent_pb2
from services.agent.run_store import (
    ANSWERED_STATES,
    RUNNING,
    Handoff,
    Lease,
    LeaseLost,
    Orphan,
    RunRecord,
    Turn,
    TurnKey,
)

PREFIX = "aimesh:agent:"
LEASES = PREFIX + "leases"
HANDOFFS = PREFIX + "handoffs"

# KEYS: run, events, leases. ARGV: body, seq, state, now, answer text, checkpoint,
# has checkpoint, RUNNING, retention seconds, run id, owner. Returns -1 if `owner` does
# not hold the run, else the cancel flag (an event of that seq stored already is not
# stored again: an append tried again after a lost reply).
_APPEND = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[11] then return -1 end
local stored = tonumber(redis.call('HGET', KEYS[1], 'events') or '0')
if stored >= tonumber(ARGV[2]) then
  return tonumber(redis.call('HGET', KEYS[1], 'cancel') or '0')
end
redis.call('RPUSH', KEYS[2], ARGV[1])
local answer = redis.call('HGET', KEYS[1], 'answer') or ''
redis.call('HSET', KEYS[1], 'events', ARGV[2], 'state', ARGV[3], 'updated_at', ARGV[4],
           'answer', answer .. ARGV[5])
if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'checkpoint', ARGV[6]) end
if ARGV[3] ~= ARGV[8] then
  redis.call('ZREM', KEYS[3], ARGV[10])
  redis.call('EXPIRE', KEYS[1], ARGV[9])
  redis.call('EXPIRE', KEYS[2], ARGV[9])
end
return tonumber(redis.call('HGET', KEYS[1], 'cancel') or '0')
"""
# KEYS: run, leases. ARGV: owner, new expiry, now, run id, claim (1) or renew (0).
# Claim: takes the run if its lease ran out; renew: extends it if `owner` holds it (1
# also for a run of its own that ended: nothing to extend, still its own).
_LEASE = """
local score = redis.call('ZSCORE', KEYS[2], ARGV[4])
if ARGV[5] == '1' then
  if not score or tonumber(score) >= tonumber(ARGV[3]) then return 0 end
else
  if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
  if not score then return 1 end
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[4])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'lease_until', ARGV[2])
return 1
"""


def _run(run_id: str) -> str:
    return f"{PREFIX}run:{run_id}"


def _session(client: str, session_id: str) -> str:
    return f"{PREFIX}session:{client}:{session_id}"


class RedisRunStore:
    # Connection refused or reset, a timeout, a server still loading its data after a
    # restart, a replica that cannot be written: the store's faults, not the request's.
    FAILURES = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)

    def __init__(self, url: str, retention_s: float = 86_400.0) -> None:
        self.retention_s = retention_s
        self._redis = redis.Redis.from_url(url, socket_timeout=5)
        self._append = self._redis.register_script(_APPEND)
        self._lease = self._redis.register_script(_LEASE)

    def close(self) -> None:
        self._redis.close()

    def create(self, request: agent_pb2.RunRequest, run_id: str, client: str, lease: Lease) -> None:
        now = time.time()
        record = {
            "client": client,
            "question": request.question,
            "state": RUNNING,
            "events": 0,
            "cancel": 0,
            "created_at": now,
            "updated_at": now,
            "session_id": request.session_id,
            "answer": "",
            "request": request.SerializeToString(),
            "owner": lease.owner,
            "lease_until": now + lease.seconds,
        }
        pipe = self._redis.pipeline()
        pipe.hset(_run(run_id), mapping=record)
        pipe.zadd(LEASES, {run_id: now + lease.seconds})
        if request.session_id:
            session = _session(client, request.session_id)
            pipe.zadd(session, {run_id: now})
            pipe.expire(session, int(self.retention_s))
        pipe.execute()

    def append(
        self,
        event: agent_pb2.RunResponse,
        state: int = RUNNING,
        checkpoint: bytes | None = None,
        *,
        owner: str,
    ) -> bool:
        body = zlib.compress(event.SerializeToString())
        text = event.answer_delta.text if event.HasField("answer_delta") else ""
        key = _run(event.run_id)
        cancel = self._append(
            keys=[key, key + ":events", LEASES],
            args=[
                body,
                event.seq,
                state,
                time.time(),
                text,
                checkpoint or b"",
                1 if checkpoint is not None else 0,
                RUNNING,
                int(self.retention_s),
                event.run_id,
                owner,
            ],
        )
        if cancel == -1:
            raise LeaseLost(f"run {event.run_id} is not held by {owner}")
        return cancel == 1

    def renew(self, lease: Lease, run_ids: list[str]) -> list[str]:
        """Extends the lease on those of these runs `lease.owner` still holds; which
        those are (its runs that ended too). Records the replica's renewal either way
        (a write, also with no runs: an idle replica sees a store it cannot write)."""
        now = time.time()
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(f"{PREFIX}replica:{lease.owner}", now, ex=max(60, int(10 * lease.seconds)))
        for run_id in run_ids:
            self._lease(
                keys=[_run(run_id), LEASES],
                args=[lease.owner, now + lease.seconds, 0, run_id, 0],
                client=pipe,
            )
        _, *renewed = pipe.execute()
        return [run_id for run_id, held in zip(run_ids, renewed, strict=True) if held == 1]

    def claim_orphans(self, lease: Lease, limit: int) -> list[Orphan]:
        now = time.time()
        expired = self._redis.zrangebyscore(LEASES, "-inf", now, start=0, num=limit)
        claimed = []
        for raw in expired:
            run_id = raw.decode()
            key = _run(run_id)
            took = self._lease(
                keys=[key, LEASES], args=[lease.owner, now + lease.seconds, now, run_id, 1]
            )
            if not took:
                continue  # another replica was first
            fields = self._redis.hmget(key, "client", "request", "checkpoint", "answer", "events")
            client, request, checkpoint, answer, events = fields
            claimed.append(
                Orphan(
                    run_id,
                    client.decode(),
                    agent_pb2.RunRequest.FromString(request),
                    checkpoint or None,
                    answer.decode(),
                    int(events),
                )
            )
        return claimed

    def hand_off(
        self, run_id: str, client: str, request: agent_pb2.RunRequest, notes: list[str]
    ) -> None:
        pipe = self._redis.pipeline()
        pipe.hset(
            f"{PREFIX}handoff:{run_id}",
            mapping={"client": client, "question": request.question, "notes": json.dumps(notes)},
        )
        pipe.zadd(HANDOFFS, {run_id: time.time()})
        pipe.execute()

    def handoffs(self, limit: int) -> list[Handoff]:
        found = []
        for raw, at in self._redis.zrange(HANDOFFS, 0, limit - 1, withscores=True):
            run_id = raw.decode()
            client, question, notes = self._redis.hmget(
                f"{PREFIX}handoff:{run_id}", "client", "question", "notes"
            )
            if question is not None:
                found.append(
                    Handoff(run_id, client.decode(), question.decode(), json.loads(notes), at)
                )
        return found

    def take_handoff(self, run_id: str) -> bool:
        pipe = self._redis.pipeline()
        pipe.zrem(HANDOFFS, run_id)
        pipe.delete(f"{PREFIX}handoff:{run_id}")
        removed, _ = pipe.execute()
        return removed == 1

    def cancels_asked(self, run_ids: list[str]) -> list[str]:
        pipe = self._redis.pipeline()
        for run_id in run_ids:
            pipe.hget(_run(run_id), "cancel")
        return [
            run_id for run_id, flag in zip(run_ids, pipe.execute(), strict=True) if flag == b"1"
        ]

    def request_cancel(self, run_id: str) -> None:
        state = self._redis.hget(_run(run_id), "state")
        if state is not None and int(state) == RUNNING:
            self._redis.hset(_run(run_id), "cancel", 1)

    def get(self, run_id: str, client: str) -> RunRecord | None:
        fields = ("client", "question", "state", "events", "cancel", "created_at", "updated_at")
        values = self._redis.hmget(_run(run_id), *fields)
        if values[0] is None or values[0].decode() != client:
            return None
        owner, question, state, events, cancel, created, updated = values
        return RunRecord(
            run_id,
            owner.decode(),
            question.decode(),
            int(state),
            int(events),
            cancel == b"1",
            float(created),
            float(updated),
        )

    def turns(
        self,
        client: str,
        session_id: str,
        after: TurnKey | None = None,
        limit: int | None = None,
    ) -> list[Turn]:
        """The session's answered runs after `after`, oldest first (by start, then id:
        the sorted set's own order), at most `limit`; read a chunk of the set at a time."""
        session = _session(client, session_id)
        low = "-inf" if after is None else repr(after.created_at)
        turns: list[Turn] = []
        gone: list[str] = []
        offset = 0
        chunk = max(64, 2 * (limit or 0))
        while limit is None or len(turns) < limit:
            members = self._redis.zrangebyscore(
                session, low, "+inf", start=offset, num=chunk, withscores=True
            )
            offset += len(members)
            run_ids = [
                raw.decode()
                for raw, score in members
                if after is None or TurnKey(score, raw.decode()) > after
            ]
            turns += self._answered(run_ids, gone)
            if len(members) < chunk:
                break
        if gone:
            self._redis.zrem(session, *gone)
        return turns if limit is None else turns[:limit]

    def _answered(self, run_ids: list[str], gone: list[str]) -> list[Turn]:
        """These runs' turns, those answered; the ids of runs expired with their
        retention window go to `gone`, to leave the session."""
        pipe = self._redis.pipeline()
        for run_id in run_ids:
            pipe.hmget(_run(run_id), "question", "answer", "state", "created_at")
        turns = []
        for run_id, (question, answer, state, created) in zip(run_ids, pipe.execute(), strict=True):
            if question is None:
                gone.append(run_id)
            elif int(state) in ANSWERED_STATES:
                turns.append(
                    Turn(run_id, question.decode(), answer.decode(), int(state), float(created))
                )
        return turns

    def delete_session(self, client: str, session_id: str) -> int:
        session = _session(client, session_id)
        deleted = 0
        for raw in self._redis.zrange(session, 0, -1):
            run_id = raw.decode()
            state = self._redis.hget(_run(run_id), "state")
            if state is not None and int(state) == RUNNING:
                continue
            deleted += state is not None
            self._redis.delete(_run(run_id), _run(run_id) + ":events")
            self._redis.zrem(session, run_id)
        return deleted

    def events(self, run_id: str, after_seq: int, limit: int = 256) -> list[agent_pb2.RunResponse]:
        bodies = self._redis.lrange(_run(run_id) + ":events", after_seq, after_seq + limit - 1)
        return [agent_pb2.RunResponse.FromString(zlib.decompress(body)) for body in bodies]
