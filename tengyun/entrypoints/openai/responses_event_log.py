"""EventLog: the SSE events of a background streamed response (`"background": true, "stream":
true`), kept so that any number of readers can follow them, from the start (the POST that made
it) or after a sequence number (`GET /v1/responses/{id}?stream=true&starting_after=N`), while
the run goes on without them.

Invariant: events[i] is the event whose sequence_number is i (the stream numbers its events 0, 1,
2, ... in the order they are appended), so `starting_after=N` reads from events[N + 1]. A reader
ends when the log is closed (the run completed, failed or was cancelled) and it has read all.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator


class EventLog:
    def __init__(self) -> None:
        self.events: list[str] = []  # whole SSE events ("event: TYPE\ndata: {...}\n\n")
        self.closed = False
        self._changed = asyncio.Event()  # set (and replaced) on every append and on close

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, start: int = 0) -> AsyncIterator[str]:
        """events[start:], then each new one as it comes, until the log is closed."""
        index = start
        while True:
            changed = self._changed  # taken before the check: an append after it sets this one
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.closed:
                return
            await changed.wait()
