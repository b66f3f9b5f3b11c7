"""Several async streams read side by side: the choices of one request, each generated
by its own sequence, go out as one stream in the order their items come.

asyncio has no merge of async iterators (aiostream has one, a whole library for this
one function); this keeps one read in flight per stream, so a stream runs at most one
item ahead of its consumer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def _next(stream: AsyncIterator[T]) -> T:
    return await anext(stream)


async def interleaved(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Every item of `streams` as it comes, with its stream's index. A stream's error
    ends it all and is raised here; closing this generator cancels the reads in flight
    (the streams themselves are their owner's to close). One stream is read directly,
    without a task."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    reads = {asyncio.create_task(_next(stream)): index for index, stream in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=reads.__getitem__):
                index = reads.pop(read)
                try:
                    item = read.result()
                except StopAsyncIteration:
                    continue
                reads[asyncio.create_task(_next(streams[index]))] = index
                yield index, item
    finally:
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
