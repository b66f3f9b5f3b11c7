"""Decode's allow-list of prefill workers: a KV handle cannot make decode dial anywhere."""

from __future__ import annotations

import pytest

from services.decode.sources import PrefillSources

pytestmark = pytest.mark.unit


async def test_configured_targets_and_what_their_names_resolve_to_are_allowed():
    sources = PrefillSources(["127.0.0.1:50062", "dns:///localhost:7000"])
    assert await sources.allows("127.0.0.1:50062")
    assert await sources.allows("127.0.0.1:7000")  # localhost's address, the named port


async def test_any_other_address_is_refused():
    sources = PrefillSources(["127.0.0.1:50062", "dns:///localhost:7000"])
    for address in (
        "127.0.0.1:50063",
        "127.0.0.2:50062",
        "169.254.169.254:80",
        "evil.invalid:50062",
        "not an address",
        "",
        "x" * 100_000,
    ):
        assert not await sources.allows(address), address


async def test_unknown_addresses_resolve_names_again_at_most_once_per_interval(monkeypatch):
    from mesh import targets

    lookups = []

    async def resolve(target: str) -> set[tuple[str, int]]:
        lookups.append(target)
        return set()

    monkeypatch.setattr(targets, "resolve", resolve)
    now = [0.0]
    sources = PrefillSources(["dns:///prefill.svc:50062"], refresh_s=5.0, clock=lambda: now[0])
    for i in range(100):
        assert not await sources.allows(f"10.0.0.{i}:50062")
    assert lookups == ["dns:///prefill.svc:50062"]
    now[0] = 5.0
    await sources.allows("10.0.0.1:50062")
    assert len(lookups) == 2
