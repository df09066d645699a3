"""The engine thread: every load and generation of the process runs on it, in order.

One thread, because MLX computes one thing at a time anyway and the CPU backend's
side stream belongs to the thread that made it. Callers queue a job and read what it
produces from their own `Generation` (engine/generation.py), so a caller that stops
reading never blocks the others.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from .generation import Cancelled, Channel, Generation


def submit(job: Callable[[Channel], None]) -> Generation:
    """Queue `job(channel)` on the engine thread; the handle reads what it puts there,
    and raises what it raised."""
    generation = Generation()
    channel = generation.channel  # the engine thread gets the channel, never the handle
    _engine_thread().submit(lambda: job(channel), channel)
    return generation


class _EngineThread:
    """The one thread that runs every job, in submission order; a job never waits on
    another job."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="mlx-stream-engine", daemon=True).start()

    def submit(self, job, channel: Channel) -> None:
        self._jobs.put((job, channel))

    def _loop(self) -> None:
        while True:
            job, channel = self._jobs.get()
            channel.running.set()
            try:
                job()
            except Cancelled:
                pass  # the caller has gone
            except BaseException as e:  # the caller re-raises it, KeyboardInterrupt included
                channel.put("error", e)
            finally:
                channel.finished.set()
                del job, channel


class Once:
    """A process-wide object, built by `factory` on first use, once whatever the threads."""

    def __init__(self, factory: Callable) -> None:
        self._factory, self._value = factory, None
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value


_engine_thread = Once(_EngineThread)
