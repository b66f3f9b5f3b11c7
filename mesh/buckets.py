"""Token buckets and budgets by name, in this process or in one Redis shared by replicas.

The gateway meters tenants' requests and tokens with them, the edge's authorizer its
tenants' requests; with `redis://...` every replica of either draws from the same bucket,
so a tenant's minute is its minute however many replicas it reaches.

  bucket   a level that refills continuously at `rate` per second up to `capacity`
  budget   an amount spent against `capacity` (a counter, never refilled; dropped `ttl_s`
           after its last charge when it has one)

`take` is all-or-nothing across the limits it is given: either every bucket and budget had
room and all were charged, or none was and the answer says which limit refused and when
its bucket will have room. In Redis that is one Lua script (atomic on the server, clocked
by the server's TIME, so replicas with skewed clocks agree). No rate-limit library fits:
the well-kept ones (limits, aiolimiter) have no all-or-nothing charge across several
limits, no forced settlement below zero, and no budgets.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

URL_PATTERN = r"^(memory|(redis|rediss|unix)://.*)$"


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

    async def close(self) -> None:
        await self.client.aclose()


class LocalWhileDown:
    """Shared buckets that fall back to this process's own while the shared store fails:
    for a limit that protects (the edge's requests per minute), a Redis outage should
    loosen the limit, not refuse every request nor admit all of them. Each replica then
    allows the tenant's whole rate on its own (N replicas: up to N times it). Any error of
    the store counts as an outage; it is tried again `retry_s` after each failure."""

    def __init__(self, shared: Buckets, *, retry_s: float = 5.0) -> None:
        self.shared = shared
        self.local = MemoryBuckets()
        self.retry_s = retry_s
        self._down_until = 0.0

    async def take(self, limits: list[Limit], *, force: bool = False) -> Refusal | None:
        now = time.monotonic()
        if now >= self._down_until:
            try:
                return await self.shared.take(limits, force=force)
            except Exception as error:
                log.error(
                    "the shared limits store failed; limiting in this process until it answers",
                    extra={"problem": type(error).__name__, "retry_s": self.retry_s},
                )
                self._down_until = now + self.retry_s
        return await self.local.take(limits, force=force)

    async def close(self) -> None:
        await self.shared.close()


def open_buckets(setting: str, *, timeout_s: float = 2.0) -> MemoryBuckets | RedisBuckets:
    """`memory`, or a redis:// (rediss://, unix://) URL."""
    if setting == "memory":
        return MemoryBuckets()
    return RedisBuckets(setting, timeout_s=timeout_s)
