"""The ``llm.AsyncModel`` twin of every ``mlx-stream`` id.

It shares the one process-wide engine with the sync model and gives the same events:
in this process it awaits the reply core's `AsyncReply` on the event loop, as the
server does, so a prompt holds no thread of its own. A consumer that stops (its task
cancelled, the stream closed) cancels the reply, which stops at the engine's next
token. A prompt routed to a running `llm mlxs serve` reads the server's stream through
the client's blocking HTTP connection, on a worker thread.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Iterator, Optional

import llm

from ..options.settings import Options
from ..reply.core import AsyncReply
from .model import MlxStreamModel, llm_events


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
        ask, server = await asyncio.to_thread(self.sync.asked, prompt)  # it may ask a server's /health
        if server is not None:
            events = in_worker(lambda hook: server.answer(self.model_id, ask, hook))
        else:
            events = AsyncReply(ask).events()
        try:
            async for event in events:
                for llm_event in llm_events(event, response):
                    yield llm_event
        finally:
            await events.aclose()  # a reply the consumer left is cancelled, now


async def in_worker(make: Callable[[Callable], Iterator]):
    """Iterate `make(on_handle)` in a worker thread; cancel the handles it is told of
    when the consumer stops early (task cancelled, generator closed)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    handles: list = []
    stopped = threading.Event()

    def hand(handle) -> None:  # one handed over after the consumer stopped is cancelled at once
        handles.append(handle)
        if stopped.is_set():
            handle.cancel()

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
            for handle in list(handles):
                handle.cancel()
