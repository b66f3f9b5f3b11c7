"""The store the meter (mesh/metering.py) keeps its state in: the buckets and budgets of
mesh/buckets.py, and beside them the usage ledger (requests, prompt and completion
tokens, images, by tenant and model). In this process ("memory"), in one SQLite file
shared by the processes of a machine ("sqlite", the default), or in Redis (a URL, shared
by every machine), so a quota spent through one door or replica is spent on all of them.

State is keyed by tenant names, never keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Protocol

from mesh.buckets import (
    CHARGE,
    Buckets,
    Limit,
    MemoryBuckets,
    RedisBuckets,
    Refusal,
    SqliteBuckets,
    charge_args,
)

__all__ = ["PREFIX", "Limit", "LocalWhileDown", "Refusal", "Store", "open_store"]

log = logging.getLogger(__name__)

PREFIX = "aimesh:limits:"
USAGE_KINDS = ("requests", "prompt_tokens", "completion_tokens", "images")
# A usage field joins kind, tenant and model with tabs: tenants are printable ASCII
# without spaces (mesh/keys.py), kinds are fixed, the model comes last and may hold anything.
SEP = "\t"
Rows = dict[tuple[str, str], dict[str, int]]
# A settlement's id is remembered this long, so a retry of one that landed (its answer
# lost to a timeout) lands no second time.
SETTLED_TTL_MS = 3_600_000


class Store(Buckets, Protocol):
    async def settle(
        self, settlement: str, limits: list[Limit], tenant: str, model: str, counts: dict[str, int]
    ) -> None:
        """Charges `limits` regardless (a reservation's difference given back or taken)
        and adds `counts` to the ledger, both or neither, once per `settlement` id however
        often it is sent."""
        ...

    async def usage(self) -> Rows:
        """(tenant, model) -> counts by kind."""
        ...


class MemoryStore(MemoryBuckets):
    """One process's buckets and ledger."""

    def __init__(self) -> None:
        super().__init__()
        self._usage: Rows = {}

    async def settle(
        self, settlement: str, limits: list[Limit], tenant: str, model: str, counts: dict[str, int]
    ) -> None:
        await self.take(limits, force=True)
        if counts:
            row = self._usage.setdefault((tenant, model), dict.fromkeys(USAGE_KINDS, 0))
            for kind, count in counts.items():
                row[kind] += count

    async def usage(self) -> Rows:
        return {key: dict(row) for key, row in self._usage.items()}


class SqliteStore(SqliteBuckets):
    """The buckets and the ledger (one table) in one file, for every process of a machine."""

    SCHEMA = (
        SqliteBuckets.SCHEMA
        + """
        CREATE TABLE IF NOT EXISTS usage (kind TEXT NOT NULL, tenant TEXT NOT NULL,
                                          model TEXT NOT NULL, count INTEGER NOT NULL,
                                          PRIMARY KEY (kind, tenant, model));
    """
    )

    def _settle(self, limits: list[Limit], tenant: str, model: str, counts: dict[str, int]) -> None:
        rows = [(kind, tenant, model, count) for kind, count in counts.items() if count]
        now = time.time()
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self._take_in(limits, True, now)
                self.db.executemany(
                    "INSERT INTO usage VALUES (?, ?, ?, ?) ON CONFLICT (kind, tenant, model) "
                    "DO UPDATE SET count = count + excluded.count",
                    rows,
                )
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    async def settle(
        self, settlement: str, limits: list[Limit], tenant: str, model: str, counts: dict[str, int]
    ) -> None:
        """One transaction, which either commits or raises: a local file leaves no write
        half-known, so the id needs no remembering."""
        await asyncio.to_thread(self._settle, limits, tenant, model, counts)

    def _usage(self) -> Rows:
        with self._lock:
            found = self.db.execute("SELECT kind, tenant, model, count FROM usage").fetchall()
        rows: Rows = {}
        for kind, tenant, model, count in found:
            if kind in USAGE_KINDS:
                rows.setdefault((tenant, model), dict.fromkeys(USAGE_KINDS, 0))[kind] = count
        return rows

    async def usage(self) -> Rows:
        return await asyncio.to_thread(self._usage)


# KEYS: the limits', then the settlement's id, then the usage hash. ARGV: CHARGE's (see
# charge_args), then the id's lifetime in ms, then field, count pairs for the hash.
SETTLE = (
    CHARGE
    + """
local n = tonumber(ARGV[2])
if not redis.call('SET', KEYS[n + 1], '1', 'NX', 'PX', ARGV[4 * n + 3]) then
  return 0
end
charge(n, true)
for j = 4 * n + 4, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[n + 2], ARGV[j], ARGV[j + 1])
end
return 1
"""
)


class RedisStore(RedisBuckets):
    """The buckets and the ledger (one hash) in one Redis, shared by every replica on it.

    A command whose answer timed out may still run once Redis reads it, so a settlement
    retried after a timeout is one script that first claims its id: it lands once."""

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        super().__init__(url, timeout_s=timeout_s)
        self._settle = self.client.register_script(SETTLE)

    async def settle(
        self, settlement: str, limits: list[Limit], tenant: str, model: str, counts: dict[str, int]
    ) -> None:
        args = [*charge_args(limits, force=True), str(SETTLED_TTL_MS)]
        for kind, count in counts.items():
            if count:
                args += [SEP.join((kind, tenant, model)), str(count)]
        keys = [limit.key for limit in limits]
        await self._settle(
            keys=[*keys, f"{PREFIX}settled:{settlement}", PREFIX + "usage"], args=args
        )

    async def usage(self) -> Rows:
        rows: Rows = {}
        for field, count in (await self.client.hgetall(PREFIX + "usage")).items():
            kind, tenant, model = field.split(SEP, 2)
            if kind in USAGE_KINDS:
                rows.setdefault((tenant, model), dict.fromkeys(USAGE_KINDS, 0))[kind] = int(count)
        return rows


class LocalWhileDown:
    """A shared store whose buckets fall back to this process's own while it fails: for a
    limit that protects (the edge's requests per minute), a Redis outage should loosen the
    limit, not refuse every request nor admit all of them. Each replica then allows the
    tenant's whole rate on its own (N replicas: up to N times it). Any error of the store
    counts as an outage; it is tried again `retry_s` after each failure. The ledger has no
    such fallback: its settlements are retried by the meter, never kept apart."""

    def __init__(self, shared: Store, *, retry_s: float = 5.0) -> None:
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

    async def settle(
        self, settlement: str, limits: list[Limit], tenant: str, model: str, counts: dict[str, int]
    ) -> None:
        await self.shared.settle(settlement, limits, tenant, model, counts)

    async def usage(self) -> Rows:
        return await self.shared.usage()

    async def close(self) -> None:
        await self.shared.close()


def open_store(setting: str, cache_dir: Path, *, timeout_s: float = 2.0) -> Store:
    """`memory`, `sqlite` (<cache_dir>/limits.sqlite), `sqlite:PATH`, or a redis://
    (rediss://, unix://) URL."""
    if setting == "memory":
        return MemoryStore()
    if setting == "sqlite":
        return SqliteStore(cache_dir / "limits.sqlite")
    if setting.startswith("sqlite:"):
        return SqliteStore(Path(setting.removeprefix("sqlite:")))
    return RedisStore(setting, timeout_s=timeout_s)
