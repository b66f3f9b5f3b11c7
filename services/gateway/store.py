"""Where the per-tenant limits and the usage ledger live: in this process (the default,
one gateway) or in Redis (`limits_store = "redis://..."`, shared by every replica, so a
quota spent through one gateway is spent on all of them).

The limits are mesh/buckets.py's buckets and budgets, keyed by tenant names (never keys);
the ledger counts requests, prompt and completion tokens and images by tenant and model,
beside them in the same store.
"""

from __future__ import annotations

from typing import Protocol

from mesh.buckets import Buckets, Limit, MemoryBuckets, RedisBuckets, Refusal

__all__ = ["PREFIX", "Limit", "Refusal", "Store", "open_store"]

PREFIX = "aimesh:gateway:"
USAGE_KINDS = ("requests", "prompt_tokens", "completion_tokens", "images")
# A usage field joins kind, tenant and model with tabs: tenants are printable ASCII
# without spaces (keys.py), kinds are fixed, the model comes last and may hold anything.
SEP = "\t"


class Store(Buckets, Protocol):
    async def record(self, tenant: str, model: str, counts: dict[str, int]) -> None: ...

    async def usage(self) -> dict[tuple[str, str], dict[str, int]]:
        """(tenant, model) -> counts by kind."""
        ...


class MemoryStore(MemoryBuckets):
    """One process's buckets and ledger."""

    def __init__(self) -> None:
        super().__init__()
        self._usage: dict[tuple[str, str], dict[str, int]] = {}

    async def record(self, tenant: str, model: str, counts: dict[str, int]) -> None:
        row = self._usage.setdefault((tenant, model), dict.fromkeys(USAGE_KINDS, 0))
        for kind, count in counts.items():
            row[kind] += count

    async def usage(self) -> dict[tuple[str, str], dict[str, int]]:
        return {key: dict(row) for key, row in self._usage.items()}


class RedisStore(RedisBuckets):
    """The buckets and the ledger (one hash) in one Redis, shared by every gateway on it."""

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


def open_store(setting: str) -> Store:
    """`memory`, or a redis:// (rediss://, unix://) URL."""
    if setting == "memory":
        return MemoryStore()
    return RedisStore(setting)
