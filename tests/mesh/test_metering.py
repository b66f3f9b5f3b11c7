"""The mesh's meter (mesh/metering.py) on its own: limits read from the tenants file,
refusals that say which limit and when, reservations settled to what was used, budgets by
period, the ledger, and a settlement that waits out a store outage (a real redis-server
stopped with SIGSTOP) instead of losing what a tenant used."""

from __future__ import annotations

import asyncio
import logging
import signal
from datetime import UTC, datetime, timedelta

import pytest

from mesh.config import LimitsSettings
from mesh.failures import QuotaExceeded
from mesh.ledger import PREFIX, MemoryStore, RedisStore, SqliteStore
from mesh.metering import Meter, MeterUnavailable, TenantLimits, TenantsFile, warn_unenforced
from tests.services.gateway.conftest import write_keys

pytestmark = pytest.mark.unit


def tenants_file(tmp_path, tenants: dict[str, dict]) -> TenantsFile:
    path = tmp_path / "keys.json"
    write_keys(path, {"k": ("t", ["generate"])}, tenants)
    return TenantsFile(path)


def test_limits_come_from_the_tenants_tables_and_a_broken_file_keeps_the_last(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.t]\nrequests_per_minute = 5\ntoken_budget = 100\n")
    tenants = TenantsFile(path)
    assert tenants.limits("t") == TenantLimits(requests_per_minute=5, token_budget=100)
    assert tenants.limits("other") == TenantLimits()
    path.write_text(path.read_text() + "[tenants.u]\nbogus = 1\n")  # refused: the last stays
    assert tenants.limits("t").requests_per_minute == 5
    path.write_text("[tenants.t]\ntokens_per_minute = 7\n")
    assert tenants.limits("t") == TenantLimits(tokens_per_minute=7)
    assert TenantsFile(None).limits("t") == TenantLimits()


async def test_refusals_say_which_limit_and_when_and_settlement_gives_back(tmp_path, buckets_clock):
    meter = Meter(
        MemoryStore(),
        tenants_file(tmp_path, {"t": {"requests_per_minute": 1, "tokens_per_minute": 10}}),
    )
    await meter.admit_request("t")
    with pytest.raises(QuotaExceeded) as refused:
        await meter.admit_request("t")
    assert (refused.value.reason, refused.value.retry_after_s) == ("RATE_LIMIT_EXCEEDED", 60)
    held = await meter.reserve("t", 9)
    meter.settle(held, "m", prompt_tokens=2, completion_tokens=1)  # 7 tokens left
    await meter.flush()
    with pytest.raises(QuotaExceeded) as waiting:
        await meter.reserve("t", 8)
    assert waiting.value.reason == "RATE_LIMIT_EXCEEDED"
    assert waiting.value.retry_after_s == pytest.approx(6)  # 1 token at 1/6 a second
    with pytest.raises(QuotaExceeded) as too_big:
        await meter.reserve("t", 11)
    assert (too_big.value.reason, too_big.value.retry_after_s) == ("REQUEST_TOO_LARGE", None)
    assert (await meter.reserve("t", 7)).tokens == 7
    assert await meter.usage() == {
        ("t", "m"): {"requests": 1, "prompt_tokens": 2, "completion_tokens": 1, "images": 0}
    }
    unlimited = await meter.reserve("free", 10**6)
    assert unlimited.tokens == 0


async def test_nothing_computed_is_nothing_recorded(tmp_path):
    meter = Meter(MemoryStore(), tenants_file(tmp_path, {"t": {"token_budget": 10}}))
    held = await meter.reserve("t", 10)
    meter.settle(held, "m")  # refused below: all of it comes back, no ledger row
    await meter.flush()
    assert await meter.usage() == {}
    assert (await meter.reserve("t", 10)).tokens == 10


async def test_a_periodic_budget_renews_and_a_late_settlement_lands_where_it_was_charged(
    tmp_path, buckets_clock
):
    today = [datetime(2026, 12, 3, 23, 0, tzinfo=UTC)]
    store = MemoryStore()
    tenants = tenants_file(tmp_path, {"t": {"token_budget": 10, "budget_period": "day"}})
    meter = Meter(store, tenants, clock=lambda: today[0])
    running = await meter.reserve("t", 8)  # a stream that will end tomorrow
    with pytest.raises(QuotaExceeded) as spent:
        await meter.reserve("t", 3)
    assert spent.value.reason == "INSUFFICIENT_QUOTA"
    assert "renews at 2026-12-04T00:00:00+00:00" in spent.value.message
    today[0] += timedelta(hours=2)
    meter.settle(running, "m", completion_tokens=2)  # gives 6 back to the 3rd, not the 4th
    await meter.flush()
    assert (await meter.reserve("t", 10)).tokens == 10  # the 4th's whole budget
    with pytest.raises(QuotaExceeded):
        await meter.reserve("t", 1)
    # The 3rd's counter outlives its day by the grace period, then goes.
    assert store._spent[f"{PREFIX}token_budget:t:2026-12-03"] == 2
    buckets_clock[0] += timedelta(days=1, hours=2).total_seconds()
    await store.take([])
    assert list(store._spent) == [f"{PREFIX}token_budget:t:2026-12-04"]


async def test_two_meters_on_one_sqlite_file_share_one_ledger_and_one_budget(tmp_path):
    """The embedded default: the gateway and the generation router, two processes of one
    machine, on one file."""
    path = tmp_path / "limits.sqlite"
    tenants = tenants_file(tmp_path, {"t": {"token_budget": 10}})
    gateway, router = Meter(SqliteStore(path), tenants), Meter(SqliteStore(path), tenants)
    try:
        held = await router.reserve("t", 6)
        with pytest.raises(QuotaExceeded):
            await gateway.reserve("t", 5)
        router.settle(held, "llm", prompt_tokens=3, completion_tokens=1)
        await router.flush()
        embedded = await gateway.reserve("t", 6)  # 4 spent, 6 left
        gateway.settle(embedded, "embed", prompt_tokens=6)
        await gateway.flush()
        assert (
            await gateway.usage()
            == await router.usage()
            == {
                ("t", "llm"): {
                    "requests": 1,
                    "prompt_tokens": 3,
                    "completion_tokens": 1,
                    "images": 0,
                },
                ("t", "embed"): {
                    "requests": 1,
                    "prompt_tokens": 6,
                    "completion_tokens": 0,
                    "images": 0,
                },
            }
        )
    finally:
        await gateway.close()
        await router.close()


@pytest.mark.service  # a real redis-server
async def test_a_settlement_waits_out_a_store_outage_instead_of_losing_usage(
    tmp_path, redis_server
):
    tenant = f"outage-{tmp_path.name}"  # the session's Redis is shared: a tenant of its own
    tenants = tenants_file(tmp_path, {tenant: {"token_budget": 100}})
    meter = Meter(RedisStore(redis_server.url, timeout_s=0.3), tenants)
    try:
        held = await meter.reserve(tenant, 50)
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            meter.settle(held, "m", prompt_tokens=7, completion_tokens=3)
            with pytest.raises(MeterUnavailable):
                await meter.reserve(tenant, 1)  # while down, nobody is charged or served
            await asyncio.sleep(1.0)
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        await asyncio.wait_for(meter.flush(), timeout=30)
        # Sent several times (each try timed out, and Redis ran them all once it woke),
        # landed once.
        row = (await meter.usage())[(tenant, "m")]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (1, 7, 3)
        # 10 spent, 40 given back once. (The refused reservation of 1 may have run too once
        # Redis woke: a request refused during an outage can still be charged.)
        assert (await meter.reserve(tenant, 89)).tokens == 89
    finally:
        await meter.close()


def test_limits_left_in_a_key_file_no_meter_reads_are_reported(tmp_path, caplog):
    keys = tmp_path / "keys.json"
    write_keys(keys, {"k": ("t", ["generate"])}, {"t": {"requests_per_minute": 1}})
    with caplog.at_level(logging.ERROR, logger="mesh.metering"):
        warn_unenforced(keys, LimitsSettings())
        assert "not enforced" in caplog.text
        caplog.clear()
        warn_unenforced(keys, LimitsSettings(tenants_file=keys))
        write_keys(tmp_path / "plain.json", {"k": ("t", ["generate"])})
        warn_unenforced(tmp_path / "plain.json", LimitsSettings())
    assert not caplog.text


class HeldStore(MemoryStore):
    """A stand-in for a store whose charge, once sent, happens whether or not its caller
    waits for the answer (SQLite's in a worker thread, Redis's on the server), and is slow
    to come: it lands when `go` is set, so a test can cancel the caller meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.charging = asyncio.Event()
        self.go = asyncio.Event()

    async def take(self, limits, *, force: bool = False):
        if force:
            return await super().take(limits, force=True)
        self.charging.set()
        return await asyncio.shield(self._when_go(limits))

    async def _when_go(self, limits):
        await self.go.wait()
        return await super().take(limits)


async def test_a_caller_that_leaves_while_its_reservation_is_charged_gets_it_back(tmp_path):
    store = HeldStore()
    meter = Meter(store, tenants_file(tmp_path, {"t": {"token_budget": 10}}))
    waiting = asyncio.create_task(meter.reserve("t", 10))
    await store.charging.wait()
    waiting.cancel()
    store.go.set()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for _ in range(3):  # the charge lands, then its give-back is settled
        await asyncio.sleep(0)
    await meter.flush()
    assert (await meter.reserve("t", 10)).tokens == 10  # the whole budget is there again
    assert await meter.usage() == {}
