"""One running job's events, from its worker thread to its stream, in bounded memory.

The worker must never wait for the reader (it holds a compute slot), and a reader slower
than the job must not make the server hold every event the job ever made. Only the
newest Progress matters, so a waiting one is replaced; Previews are kept for a few rounds
of the batch and the oldest dropped past that (the API says the server may send fewer);
Images are never dropped and number at most one per image of the batch.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator

from aimesh.diffusion.v1 import diffusion_pb2

# Rounds of previews (one per image each) a slow reader may have waiting.
PREVIEW_ROUNDS = 4

Event = diffusion_pb2.GenerateResponse


class JobEvents:
    """`push` from the worker thread, `close` on the loop once it has returned, `drain`
    on the loop: the events in order, less the Progress and Previews a slow reader missed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, images: int) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._progress: Event | None = None
        self._previews: deque[Event] = deque(maxlen=PREVIEW_ROUNDS * images)
        self._images: deque[Event] = deque()
        self._closed = False
        # Whether a wake-up is on its way to the loop: one at a time, however fast the
        # worker pushes.
        self._waking = False
        self._ready = asyncio.Event()

    def push(self, event: Event) -> None:
        """Never blocks beyond a short lock, and holds a bounded number of events."""
        kind = event.WhichOneof("event")
        with self._lock:
            if kind == "progress":
                self._progress = event
            elif kind == "preview":
                self._previews.append(event)
            else:
                self._images.append(event)
            wake = not self._waking
            self._waking = True
        if wake:
            self._loop.call_soon_threadsafe(self._ready.set)

    def close(self) -> None:
        """No more events: `drain` ends once it has handed out what is waiting."""
        with self._lock:
            self._closed = True
        self._ready.set()

    @property
    def pending(self) -> int:
        with self._lock:
            return (self._progress is not None) + len(self._previews) + len(self._images)

    async def drain(self) -> AsyncIterator[Event]:
        """What is waiting, one event at a time until closed: previews, the newest
        progress, then images, so the last step's Progress always comes before the first
        Image. Each event is taken from the bounded queues only when the reader asks for
        it, so a reader that stops holds at most one event beyond those bounds."""
        while True:
            await self._ready.wait()
            while (event := self._take()) is not None:
                yield event
            if self._closed:
                return

    def _take(self) -> Event | None:
        """The next waiting event; None when there is none, and the next push wakes."""
        with self._lock:
            if self._previews:
                return self._previews.popleft()
            if self._progress is not None:
                event, self._progress = self._progress, None
                return event
            if self._images:
                return self._images.popleft()
            self._ready.clear()
            self._waking = False
            return None
