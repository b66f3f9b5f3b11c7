"""Buckets and budgets (mesh/buckets.py): the arithmetic on a stopped clock, in memory and
in SQLite, the same in a real Redis, shared by two clients as by two replicas (two
connections to one SQLite file, as two processes of a machine), and one replica's own
while Redis is down (mesh/ledger.py's LocalWhileDown)."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from mesh.buckets import Limit, MemoryBuckets, RedisBuckets, Refusal, SqliteBuckets
from mesh.ledger import LocalWhileDown, RedisStore

pytestmark = pytest.mark.unit


@pytest.fixture(params=["memory", "sqlite"])
async def local_buckets(request, tmp_path):
    """Buckets in this process, or in a SQLite file."""
    store = MemoryBuckets() if request.param == "memory" else SqliteBuckets(tmp_path / "b.sqlite")
    yield store
    await store.close()


async def test_buckets_refill_continuously_and_charge_all_or_nothing(buckets_clock, local_buckets):
    store = local_buckets
    rpm = Limit("requests_per_minute", "r", capacity=2, rate=2 / 60, amount=1)
    tpm = Limit("tokens_per_minute", "t", capacity=10, rate=10 / 60, amount=6)
    assert await store.take([rpm, tpm]) is None
    refused = await store.take([rpm, tpm])  # rpm has room, tpm (4 left) has not
    assert refused.limit == "tokens_per_minute" and refused.wait_s == pytest.approx(12)
    assert await store.take([rpm]) is None  # the refused charge took nothing from rpm
    assert (await store.take([rpm])).wait_s == pytest.approx(30)
    buckets_clock[0] += 30
    assert await store.take([rpm]) is None
    # A settlement charges regardless, and may leave a bucket below zero: tpm had 4 + 5
    # refilled, 20 more leave it at -11, so 6 tokens are 17 away (6 s each).
    overrun = Limit("tokens_per_minute", "t", 10, 10 / 60, 20)
    assert await store.take([overrun], force=True) is None
    assert (await store.take([tpm])).wait_s == pytest.approx(17 * 6)
    too_big = Limit("tokens_per_minute", "t", 10, 10 / 60, 11)
    assert (await store.take([too_big])).wait_s is None


async def test_a_budget_never_refills(buckets_clock, local_buckets):
    store = local_buckets
    budget = Limit("token_budget", "b", capacity=10, rate=0, amount=6)
    assert await store.take([budget]) is None
    buckets_clock[0] += 10**6
    assert await store.take([budget]) == Refusal("token_budget", None)
    give_back = Limit("token_budget", "b", capacity=10, rate=0, amount=-6)
    assert await store.take([give_back], force=True) is None
    assert await store.take([budget]) is None


@pytest.mark.service  # a real redis-server
async def test_in_redis_a_periodic_budget_expires_and_a_lifetime_one_stays(redis_url):
    """The Lua script's arithmetic is MemoryBuckets's (above); here, that a past
    period's counter leaves Redis instead of piling up, one key per tenant and period."""
    store = RedisBuckets(redis_url)
    try:
        day = Limit("token_budget", "aimesh:gateway:token_budget:t:2026-12-03", 10, 0, 4, 90.0)
        life = Limit("token_budget", "aimesh:gateway:token_budget:t", 10, 0, 4)
        assert await store.take([day, life]) is None
        assert 85_000 < await store.client.pttl(day.key) <= 90_000
        assert await store.client.pttl(life.key) == -1  # no expiry
        assert await store.take([replace(day, amount=7)]) == Refusal("token_budget", None)
        assert float(await store.client.get(day.key)) == 4
    finally:
        await store.close()


@pytest.mark.service  # a real redis-server
async def test_two_replicas_on_one_redis_draw_from_one_bucket(redis_url):
    first, second = RedisBuckets(redis_url), RedisBuckets(redis_url)
    rpm = Limit("requests_per_minute", "aimesh:test:rpm:t", capacity=3, rate=3 / 60, amount=1)
    try:
        taken = [await replica.take([rpm]) for replica in (first, second, first)]
        assert taken == [None, None, None]
        refused = await second.take([rpm])
        assert refused.limit == "requests_per_minute" and 0 < refused.wait_s <= 20
    finally:
        await first.close()
        await second.close()


@pytest.mark.service  # a real redis-server
async def test_while_redis_is_down_a_replica_limits_on_its_own_then_shares_again(
    buckets_clock, redis_server
):
    """A Redis that stops answering (SIGSTOP): the take after it is this process's own
    bucket (not an error, not a free pass), and the shared one again once it answers."""
    shared = RedisStore(redis_server.url, timeout_s=0.5)
    limited = LocalWhileDown(shared, retry_s=5)
    rpm = Limit("requests_per_minute", "aimesh:test:rpm:down", capacity=1, rate=1 / 60, amount=1)
    try:
        assert await limited.take([rpm]) is None
        assert (await limited.take([rpm])).limit == "requests_per_minute"  # shared: spent
        redis_server.process.send_signal(signal.SIGSTOP)
        try:
            assert await limited.take([rpm]) is None  # timed out: the local bucket, full
            assert (await limited.take([rpm])).limit == "requests_per_minute"  # local: spent
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        buckets_clock[0] += 5
        refused = await limited.take([rpm])  # shared again, and still spent there
        assert refused.limit == "requests_per_minute" and refused.wait_s > 5
    finally:
        await shared.close()


async def test_two_processes_on_one_sqlite_file_draw_from_one_bucket(tmp_path, buckets_clock):
    path = tmp_path / "limits.sqlite"
    first, second = SqliteBuckets(path), SqliteBuckets(path)
    rpm = Limit("requests_per_minute", "rpm:t", capacity=3, rate=3 / 60, amount=1)
    budget = Limit("token_budget", "budget:t", capacity=10, rate=0, amount=4, ttl_s=60)
    try:
        taken = [await store.take([rpm, budget]) for store in (first, second)]
        assert taken == [None, None]
        assert (await first.take([rpm, budget])).limit == "token_budget"  # 8 of 10 spent
        assert await second.take([rpm]) is None  # the refused take charged nothing
        assert (await first.take([rpm])).wait_s == pytest.approx(20)
        buckets_clock[0] += 61  # the budget's key outlived its ttl: a new period's
        assert await second.take([budget]) is None
    finally:
        await first.close()
        await second.close()
