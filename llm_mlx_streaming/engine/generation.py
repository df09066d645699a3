"""A caller's handle on one generation that the engine thread runs.

The engine thread produces the responses and the caller reads them from a queue (a
thread blocks on it; a coroutine awaits it, woken by the engine thread), so
no engine lock is ever held across a `yield` to code the engine does not control: a
caller that stops reading (an abandoned stream, a slow client, a suspended chat turn)
holds nothing, and the next queued request still runs. `close()`, or the handle being
garbage-collected, cancels the generation at its next token.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional


class Cancelled(Exception):
    """Raised inside the engine thread when the caller closed its generation."""


@dataclass(frozen=True)
class Started:
    """What a generation runs on, known once its model is loaded and its cache reused."""

    tokenizer: Any
    checkpoint: Path
    prompt_tokens: list[int]
    reused_tokens: int
    max_tokens: Optional[int] = None  # the tokens it may generate: max_tokens, within the context


class Channel:
    """The engine thread's end: events out, cancellation in. It holds no reference to
    the caller's handle, so dropping the handle is enough to cancel."""

    def __init__(self) -> None:
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancel = threading.Event()
        self.running = threading.Event()
        self.finished = threading.Event()
        self.wake: Optional[Callable[[], None]] = None  # an event loop's reader waiting for the next event

    def check_cancelled(self) -> None:
        if self.cancel.is_set():
            raise Cancelled

    def put(self, kind: str, value) -> None:
        self.events.put((kind, value))
        wake = self.wake
        if wake is not None:
            wake()


class Generation:
    """Iterates mlx-lm `GenerationResponse`s; then `stats` holds the engine's figures."""

    def __init__(self) -> None:
        self.channel = Channel()
        self.started: Optional[Started] = None
        self.stats: Optional[dict] = None
        self.tokens: list[int] = []
        self.done = False
        weakref.finalize(self, self.channel.cancel.set)

    @property
    def tokenizer(self):
        return self.wait_started().started.tokenizer

    def wait_started(self) -> "Generation":
        """Wait until the model is loaded and the generation set up (raising their errors)."""
        while self.started is None:
            self._handle(self.channel.events.get())
        return self

    async def astarted(self) -> "Generation":
        """`wait_started` for a reader on an event loop: it awaits, holding no thread."""
        while self.started is None:
            self._handle(await self._next_event())
        return self

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self):
        while True:
            try:
                response = self._handle(await self._next_event())
            except StopIteration:
                raise StopAsyncIteration from None
            if response is not None:
                return response

    async def _next_event(self):
        """The next event, awaited: the engine thread wakes this loop when it puts one."""
        events = self.channel.events
        try:
            return events.get_nowait()
        except queue.Empty:
            pass
        loop, ready = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                pass

        self.channel.wake = wake
        try:
            while True:  # looked at again after `wake` is in place, so no event is missed
                try:
                    return events.get_nowait()
                except queue.Empty:
                    await ready.wait()
                    ready.clear()
        finally:
            self.channel.wake = None

    def __iter__(self) -> "Generation":
        return self

    def __next__(self):
        while True:
            response = self._handle(self.channel.events.get())
            if response is not None:
                return response

    def _handle(self, event):
        kind, value = event
        if kind == "started":
            self.started = value
            return None
        if kind == "response":
            self.tokens.append(int(value.token))
            return value
        self.done = True
        if kind == "done":
            self.stats = value
            raise StopIteration
        raise value  # "error": what the engine thread raised, as it was raised

    def cancel(self) -> None:
        """Stop the generation at its next token, from any thread; a reader waiting on
        this handle wakes at once with `Cancelled`."""
        if not self.done:
            self.channel.cancel.set()
            self.channel.put("error", Cancelled())

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop the generation at its next token; if it is running, wait until the
        engine has let go of it (a queued one is simply skipped when its turn comes)."""
        if not self.done:
            self.channel.cancel.set()
        if self.channel.running.is_set():
            self.channel.finished.wait(timeout)

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
