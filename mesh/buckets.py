"""Token buckets and budgets by name: in this process, in one SQLite file every process
of a machine shares, or in one Redis shared by every machine.

The mesh's meter (mesh/metering.py) limits tenants with them: the edge's authorizer and
the gateway take each request from its tenant's requests bucket, the generation router
its tokens. With a shared store every door and replica draws from the same bucket, so a
tenant's minute is its minute whichever way its requests come in.

  bucket   a level that refills continuously at `rate` per second up to `capacity`
  budget   an amount spent against `capacity` (a counter, never refilled; dropped `ttl_s`
           after its last charge when it has one)

`take` is all-or-nothing across the limits it is given: either every bucket and budget had
room and all were charged, or none was and the answer says which limit refused and when
its bucket will have room. In Redis that is one Lua script (atomic on the server, clocked
by the server's TIME, so replicas with skewed clocks agree); in SQLite one IMMEDIATE
transaction (the file's write lock, so processes take turns). No rate-limit library fits:
the well-kept ones (limits, aiolimiter) have no all-or-nothing charge across several
limits, no forced settlement below zero, and no budgets.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# A store setting: "memory", "sqlite" (a file in the cache directory), "sqlite:PATH" or a
# Redis URL.
STORE_PATTERN = r"^(memory|sqlite(:.+)?|(redis|rediss|unix)://.*)$"


@dataclass(frozen=True)
class Limit:
    """One limit to charge: a bucket (rate > 0) or a budget (rate == 0)."""

    name: str  # "requests_per_minute", "tokens_per_minute", "token_budget"
    key: str  # the store's key, which its user prefixes (aimesh:gateway:..., aimesh:edge:...)
    capacity: float
    rate: float  # per second; 0 for a budget
    amount: float  # to take (negative: give back)
    ttl_s: float = 0.0  # a budget's key is dropped this long after the charge; 0: kept


@dataclass(frozen=True)
class Refusal:
    limit: str  # the Limit.name that had no room
    wait_s: float | None  # when a bucket will have room; None: never (a budget, too big)


class Buckets(Protocol):
    async def take(self, limits: list[Limit], *, force: bool = False) -> Refusal | None:
        """Charges every limit, or none (force: charge regardless, as a settlement does,
        letting a level go below zero)."""
        ...

    async def close(self) -> None: ...


def _wait_s(level: float, limit: Limit) -> float | None:
    if limit.rate <= 0 or limit.amount > limit.capacity:
        return None
    return (limit.amount - level) / limit.rate


class MemoryBuckets:
    """One process's state; the same arithmetic as the Lua script below."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (level, at)
        self._spent: dict[str, float] = defaultdict(float)
        self._expires: dict[str, float] = {}  # budget key -> when it goes (its ttl_s)

    def _expire(self, now: float) -> None:
        for key in [key for key, at in self._expires.items() if at <= now]:
            del self._expires[key], self._spent[key]

    def _level(self, limit: Limit, now: float) -> float:
        level, at = self._buckets.get(limit.key, (limit.capacity, now))
        return min(limit.capacity, level + max(0.0, now - at) * limit.rate)

    async def take(self, limits: list[Limit], *, force: bool = False) -> Refusal | None:
        now = time.monotonic()
        self._expire(now)
        levels = {}
        for limit in limits:
            if limit.rate > 0:
                levels[limit.key] = self._level(limit, now)
            else:
                levels[limit.key] = limit.capacity - self._spent[limit.key]
            if not force and levels[limit.key] < limit.amount:
                return Refusal(limit.name, _wait_s(levels[limit.key], limit))
        for limit in limits:
            if limit.rate > 0:
                self._buckets[limit.key] = (levels[limit.key] - limit.amount, now)
            else:
                self._spent[limit.key] += limit.amount
                if limit.ttl_s > 0:
                    self._expires[limit.key] = now + limit.ttl_s
        return None

    async def close(self) -> None:
        pass


# CHARGE defines charge(n, force) over KEYS[1..n], one key per limit, and ARGV[3..]
# (capacity, rate, amount, ttl in ms per limit). It returns {0} when every limit was
# charged, else {index of the refusing limit (1-based), wait in ms (-1: never)}. A bucket
# is a hash {level, at}; it expires once it would be full again, so idle tenants leave
# nothing behind. A budget is a plain counter, dropped ttl ms after its last charge when
# it has one (a past period's). Scripts built on it (TAKE here, mesh/ledger.py's SETTLE)
# put their own keys after the limits'.
CHARGE = """
if redis.replicate_commands then redis.replicate_commands() end
local function charge(n, force)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local levels = {}
  for i = 1, n do
    local capacity = tonumber(ARGV[i * 4 - 1])
    local rate = tonumber(ARGV[i * 4])
    local amount = tonumber(ARGV[i * 4 + 1])
    local level
    if rate > 0 then
      local state = redis.call('HMGET', KEYS[i], 'level', 'at')
      level = tonumber(state[1]) or capacity
      local at = tonumber(state[2]) or now
      level = math.min(capacity, level + math.max(0, now - at) * rate)
    else
      level = capacity - (tonumber(redis.call('GET', KEYS[i])) or 0)
    end
    levels[i] = level
    if not force and level < amount then
      if rate <= 0 or amount > capacity then
        return {i, -1}
      end
      return {i, math.ceil((amount - level) / rate * 1000)}
    end
  end
  for i = 1, n do
    local capacity = tonumber(ARGV[i * 4 - 1])
    local rate = tonumber(ARGV[i * 4])
    local amount = tonumber(ARGV[i * 4 + 1])
    local ttl = tonumber(ARGV[i * 4 + 2])
    if rate > 0 then
      local level = levels[i] - amount
      redis.call('HSET', KEYS[i], 'level', tostring(level), 'at', tostring(now))
      local full_in = (capacity - level) / rate
      redis.call('PEXPIRE', KEYS[i], math.ceil(full_in * 1000) + 1000)
    else
      redis.call('INCRBYFLOAT', KEYS[i], tostring(amount))
      if ttl > 0 then
        redis.call('PEXPIRE', KEYS[i], ttl)
      end
    end
  end
  return {0}
end
"""
# ARGV[1]: "1" to force; ARGV[2]: the number of limits; then CHARGE's.
TAKE = CHARGE + "return charge(tonumber(ARGV[2]), ARGV[1] == '1')"


def charge_args(limits: list[Limit], *, force: bool) -> list[str]:
    """ARGV for a script built on CHARGE (TAKE's, and the first of a longer script's)."""
    args: list[str] = ["1" if force else "0", str(len(limits))]
    for limit in limits:
        args += [
            repr(limit.capacity),
            repr(limit.rate),
            repr(limit.amount),
            str(math.ceil(limit.ttl_s * 1000)),
        ]
    return args


class RedisBuckets:
    """The state in one Redis (`redis://host:port/db`), shared by every replica on it."""

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        import redis.asyncio  # only a process configured for Redis needs the client

        # Bounded waits: a Redis that stops answering is an error, not a hung request.
        self.client = redis.asyncio.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._take = self.client.register_script(TAKE)

    async def take(self, limits: list[Limit], *, force: bool = False) -> Refusal | None:
        if not limits:
            return None
        args = charge_args(limits, force=force)
        answer = await self._take(keys=[limit.key for limit in limits], args=args)
        if int(answer[0]) == 0:
            return None
        refused = limits[int(answer[0]) - 1]
        wait_ms = int(answer[1])
        return Refusal(refused.name, None if wait_ms < 0 else wait_ms / 1000)

    async def close(self) -> None:
        await self.client.aclose()


class SqliteBuckets:
    """The state in one SQLite file, shared by every process of one machine (the edge's
    authorizer, the gateway and the generation router of one `aimesh up`): the embedded
    default for a mesh on one machine, where a process's own memory would give each door
    a bucket of its own. Clocked by the wall clock, which every process of the machine
    shares (and which, unlike the monotonic one, survives a reboot the file survives).

    One connection, used by one thread at a time (a lock) off the event loop; WAL, so
    readers never wait on the writer, and a busy timeout, so a writer waits its turn."""

    BUSY_TIMEOUT_S = 5.0
    SCHEMA = """
        CREATE TABLE IF NOT EXISTS buckets (key TEXT PRIMARY KEY, level REAL NOT NULL,
                                            at REAL NOT NULL);
        CREATE TABLE IF NOT EXISTS budgets (key TEXT PRIMARY KEY, spent REAL NOT NULL,
                                            expires REAL);
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self.db = sqlite3.connect(
            path, timeout=self.BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        with self._lock:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(self.SCHEMA)

    def _take(self, limits: list[Limit], force: bool) -> Refusal | None:
        now = time.time()
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                refused = self._take_in(limits, force, now)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("ROLLBACK" if refused else "COMMIT")
            return refused

    def _take_in(self, limits: list[Limit], force: bool, now: float) -> Refusal | None:
        levels = []
        for limit in limits:
            if limit.rate > 0:
                row = self.db.execute(
                    "SELECT level, at FROM buckets WHERE key = ?", (limit.key,)
                ).fetchone()
                level, at = row if row else (limit.capacity, now)
                level = min(limit.capacity, level + max(0.0, now - at) * limit.rate)
            else:
                row = self.db.execute(
                    "SELECT spent, expires FROM budgets WHERE key = ?", (limit.key,)
                ).fetchone()
                live = row is not None and (row[1] is None or row[1] > now)
                level = limit.capacity - (row[0] if live else 0.0)
            if not force and level < limit.amount:
                return Refusal(limit.name, _wait_s(level, limit))
            levels.append(level)
        for limit, level in zip(limits, levels, strict=True):
            if limit.rate > 0:
                self.db.execute(
                    "INSERT OR REPLACE INTO buckets VALUES (?, ?, ?)",
                    (limit.key, level - limit.amount, now),
                )
            else:
                expires = now + limit.ttl_s if limit.ttl_s > 0 else None
                spent = limit.capacity - level + limit.amount
                self.db.execute(
                    "INSERT OR REPLACE INTO budgets VALUES (?, ?, ?)", (limit.key, spent, expires)
                )
        return None

    async def take(self, limits: list[Limit], *, force: bool = False) -> Refusal | None:
        if not limits:
            return None
        return await asyncio.to_thread(self._take, limits, force)

    async def close(self) -> None:
        with self._lock:
            self.db.close()
