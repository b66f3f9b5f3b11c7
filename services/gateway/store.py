"""Where the per-tenant limits and the usage ledger live: in this process (the default,
one gateway) or in Redis (`limits_store = "redis://..."`, shared by every replica, so a
quota spent through one gateway is spent on all of them).

Both hold the same state under the same names, keyed by tenant names (never keys):
  bucket   a token bucket: a level that refills continuously at `rate` per second up to
           `capacity` (requests or tokens per minute)
  budget   tokens spent against a budget (a counter, never refilled; a periodic budget
           has a key per period, which expires a day after the period ends)
  usage    the ledger: requests, prompt and completion tokens, images by tenant and model

`take` is all-or-nothing across the limits it is given: either every bucket and budget
had room and all were charged, or none was and the answer says which limit refused and
when the bucket will have room. In Redis that is one Lua script (atomic on the server,
clocked by the server's TIME, so replicas with skewed clocks agree).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

PREFIX = "aimesh:gateway:"
USAGE_KINDS = ("requests", "prompt_tokens", "completion_tokens", "images")
# A usage field joins kind, tenant and model with tabs: tenants are printable ASCII
# without spaces (keys.py), kinds are fixed, the model comes last and may hold anything.
SEP = "\t"


@dataclass(frozen=True)
class Limit:
    """One limit to charge: a bucket (rate > 0) or a budget (rate == 0)."""

    name: str  # "requests_per_minute", "tokens_per_minute", "token_budget"
    key: str  # the store's key: PREFIX + name + ":" + tenant (+ ":" + period)
    capacity: float
    rate: float  # per second; 0 for a budget
    amount: float  # to take (negative: give back)
    ttl_s: float = 0.0  # a budget's key is dropped this long after the charge; 0: kept


@dataclass(frozen=True)
class Refusal:
    limit: str  # the Limit.name that had no room
    wait_s: float | None  # when a bucket will have room; None: never (a budget, too big)


class Store(Protocol):
    async def take(self, limits: list[Limit], *, force: bool = False) -> Refusal | None:
        """Charges every limit, or none (force: charge regardless, as a settlement does,
        letting a level go below zero)."""
        ...

    async def record(self, tenant: str, model: str, counts: dict[str, int]) -> None: ...

    async def usage(self) -> dict[tuple[str, str], dict[str, int]]:
        """(tenant, model) -> counts by kind."""
        ...

    async def close(self) -> None: ...


def _wait_s(level: float, limit: Limit) -> float | None:
    if limit.rate <= 0 or limit.amount > limit.capacity:
        return None
    return (limit.amount - level) / limit.rate


class MemoryStore:
    """One process's state; the same arithmetic as the Lua script below."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (level, at)
        self._spent: dict[str, float] = defaultdict(float)
        self._expires: dict[str, float] = {}  # budget key -> when it goes (its ttl_s)
        self._usage: dict[tuple[str, str], dict[str, int]] = {}

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

    async def record(self, tenant: str, model: str, counts: dict[str, int]) -> None:
        row = self._usage.setdefault((tenant, model), dict.fromkeys(USAGE_KINDS, 0))
        for kind, count in counts.items():
            row[kind] += count

    async def usage(self) -> dict[tuple[str, str], dict[str, int]]:
        return {key: dict(row) for key, row in self._usage.items()}

    async def close(self) -> None:
        pass


# KEYS: one per limit. ARGV[1]: "1" to force; then capacity, rate, amount, ttl in ms per
# limit. Returns {0} when every limit was charged, else {index of the refusing limit
# (1-based), wait in ms (-1: never)}. A bucket is a hash {level, at}; it expires once it
# would be full again, so idle tenants leave nothing behind. A budget is a plain counter,
# dropped ttl ms after its last charge when it has one (a past period's).
TAKE = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local force = ARGV[1] == '1'
local levels = {}
for i = 1, #KEYS do
  local capacity = tonumber(ARGV[i * 4 - 2])
  local rate = tonumber(ARGV[i * 4 - 1])
  local amount = tonumber(ARGV[i * 4])
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
for i = 1, #KEYS do
  local capacity = tonumber(ARGV[i * 4 - 2])
  local rate = tonumber(ARGV[i * 4 - 1])
  local amount = tonumber(ARGV[i * 4])
  local ttl = tonumber(ARGV[i * 4 + 1])
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
"""


class RedisStore:
    """The state in one Redis (`redis://host:port/db`), shared by every gateway on it."""

    def __init__(self, url: str) -> None:
        import redis.asyncio  # only a gateway configured for Redis needs the client

        # Bounded waits: a Redis that stops answering is a 503, not a hung request.
        self.client = redis.asyncio.Redis.from_url(
            url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self._take = self.client.register_script(TAKE)

    async def take(self, limits: list[Limit], *, force: bool = False) -> Refusal | None:
        if not limits:
            return None
        args: list[str] = ["1" if force else "0"]
        for limit in limits:
            args += [
                repr(limit.capacity),
                repr(limit.rate),
                repr(limit.amount),
                str(math.ceil(limit.ttl_s * 1000)),
            ]
        answer = await self._take(keys=[limit.key for limit in limits], args=args)
        if int(answer[0]) == 0:
            return None
        refused = limits[int(answer[0]) - 1]
        wait_ms = int(answer[1])
        return Refusal(refused.name, None if wait_ms < 0 else wait_ms / 1000)

    async def record(self, tenant: str, model: str, counts: dict[str, int]) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            for kind, count in counts.items():
                if count:
                    pipe.hincrby(PREFIX + "usage", SEP.join((kind, tenant, model)), count)
            await pipe.execute()

    async def usage(self) -> dict[tuple[str, str], dict[str, int]]:
        rows: dict[tuple[str, str], dict[str, int]] = {}
        for field, count in (await self.client.hgetall(PREFIX + "usage")).items():
            kind, tenant, model = field.split(SEP, 2)
            if kind in USAGE_KINDS:
                rows.setdefault((tenant, model), dict.fromkeys(USAGE_KINDS, 0))[kind] = int(count)
        return rows

    async def close(self) -> None:
        await self.client.aclose()


def open_store(setting: str) -> Store:
    """`memory`, or a redis:// (rediss://, unix://) URL."""
    if setting == "memory":
        return MemoryStore()
    return RedisStore(setting)
