"""At most `capacity` jobs at a time; the others wait their turn in order, and only so many.

The engine decodes up to `max_batch` requests together (engine/batch.py), so the server
admits that many generations and queues the rest first come, first served. A full queue
is the caller's cue to answer 503 with Retry-After instead of letting requests pile up
without bound. Loads, unloads and pool rebuilds do not wait here: they go straight to the
engine's queue (server/hosting.py), ahead of the requests still waiting at the gate, so
those run on the new pools.
"""

from __future__ import annotations

import asyncio
from collections import deque


class QueueFull(Exception):
    pass


class Gate:
    def __init__(self, max_waiting: int, capacity: int = 1) -> None:
        self.max_waiting, self.capacity = max_waiting, capacity
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    @property
    def busy(self) -> bool:
        return self.running > 0

    async def acquire(self) -> None:
        """Wait for the turn; QueueFull at once when `max_waiting` already wait."""
        if self.running < self.capacity and not self.waiting:
            self.running += 1
            return
        if self.waiting >= self.max_waiting:
            raise QueueFull
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # the turn came as the waiter went: pass it on
            else:
                self._drop(future)
            raise

    def _drop(self, future) -> None:
        try:
            self._waiters.remove(future)
        except ValueError:
            pass

    def release(self) -> None:
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)  # the turn passes on; as many run
                return
        self.running -= 1
