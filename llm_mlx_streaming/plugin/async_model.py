"""The ``llm.AsyncModel`` twin of every ``mlx-stream`` id.

It shares the one process-wide engine with the sync model: the sync model's event
stream runs in a worker thread (which only waits on the engine thread), and its
events are handed to the event loop. Cancelling the awaiting task cancels the
engine's generation, which stops at its next token; the worker thread then ends.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Iterator, Optional

import llm

from ..options.settings import Options
from .model import MlxStreamModel


class MlxStreamAsyncModel(llm.AsyncModel):
    can_stream = True
    supports_schema = MlxStreamModel.supports_schema
    supports_tools = MlxStreamModel.supports_tools
    Options = Options

    def __init__(self, name: Optional[str] = None):
        self.sync = MlxStreamModel(name)
        self.model_id = self.sync.model_id

    def __str__(self) -> str:
        return f"MLX streaming (async): {self.model_id}"

    @property
    def attachment_types(self) -> frozenset[str]:
        return self.sync.attachment_types

    async def execute(self, prompt, stream, response, conversation):
        async for event in in_worker(lambda hook: self.sync._execute(prompt, response, hook)):
            yield event


async def in_worker(make: Callable[[Callable], Iterator]):
    """Iterate `make(on_generation)` in a worker thread; cancel its generations when
    the consumer stops early (task cancelled, generator closed)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    generations: list = []
    stopped = threading.Event()

    def hand(generation) -> None:  # one handed over after the consumer stopped is cancelled at once
        generations.append(generation)
        if stopped.is_set():
            generation.cancel()

    def post(item) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    def work() -> None:
        try:
            for event in make(hand):
                post(("event", event))
        except BaseException as exc:  # re-raised in the awaiting task
            post(("error", exc))
        else:
            post(("end", None))

    worker = threading.Thread(target=work, name="mlx-stream-async", daemon=True)
    worker.start()
    finished = False
    try:
        while True:
            kind, value = await events.get()
            if kind == "event":
                yield value
            elif kind == "error":
                finished = True
                raise value
            else:
                finished = True
                return
    finally:
        if not finished:
            stopped.set()
            for generation in list(generations):
                generation.cancel()
