"""mesh.streams.interleaved: the choices of one request read side by side."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from mesh.streams import interleaved

pytestmark = pytest.mark.unit


async def _paced(name: str, delays: list[float], log: list[str]) -> AsyncIterator[str]:
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
    finally:
        log.append(f"{name} closed")


async def test_items_come_in_the_order_they_are_made_each_with_its_streams_index():
    log: list[str] = []
    streams = [_paced("a", [0.0, 0.2], log), _paced("b", [0.1, 0.2], log)]
    got = [item async for item in interleaved(streams)]
    assert got == [(0, "a0"), (1, "b0"), (0, "a1"), (1, "b1")]
    assert sorted(log) == ["a closed", "b closed"]


async def test_one_streams_failure_is_raised_and_the_other_reads_are_cancelled():
    log: list[str] = []

    async def failing() -> AsyncIterator[str]:
        yield "x0"
        await asyncio.sleep(0.05)
        raise ValueError("engine gone")

    slow = _paced("slow", [0.0, 30.0], log)
    got: list[tuple[int, str]] = []
    with pytest.raises(ValueError, match="engine gone"):
        async for item in interleaved([failing(), slow]):
            got.append(item)
    assert sorted(got) == [(0, "x0"), (1, "slow0")]
    # The read that waited 30 s was cancelled, which ends that generator.
    assert log == ["slow closed"]


async def test_closing_early_cancels_the_reads_in_flight():
    """b's read, waiting, is cancelled (which ends b); no read of a is left running, so
    its owner can close it."""
    log: list[str] = []
    streams = [_paced("a", [0.0, 30.0], log), _paced("b", [30.0], log)]
    async with aclosing(interleaved(streams)) as items:
        assert await anext(items) == (0, "a0")
    assert log == ["b closed"]
    await asyncio.wait_for(streams[0].aclose(), timeout=5)
    assert log == ["b closed", "a closed"]


async def test_a_single_stream_is_read_as_it_is():
    log: list[str] = []
    got = [item async for item in interleaved([_paced("a", [0.0, 0.0], log)])]
    assert got == [(0, "a0"), (0, "a1")]
