"""One generation request through the gate, answered in any API's shape.

Every API (OpenAI, Anthropic, Ollama) runs the same path: wait for the turn, start the
run with the runtime parameters of that moment, then give the whole reply or stream it.
The API's shape (shapes.py, anthropic_shapes.py, ollama_shapes.py) only lays out what
the run said: `whole(reply)` is the body, `opening()`, `delta(kind, value)`,
`closing(reply)` and `failure(error)` are the stream's frames.
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from .bridge import Reply, Result, Run
from .gate import QueueFull
from .http_layer import ApiError, error_for

RETRY_AFTER_SECONDS = 2


class Turn:
    """A request's hold on the gate and its run: finishing cancels the run if it is
    still going and passes the turn on, once."""

    def __init__(self, service, run: Run) -> None:
        self.service, self.run = service, run
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def finish(self, served: bool = False) -> None:
        if self._done:
            return
        self._done = True
        if not self.run.finished:
            self.run.cancel()
        self.service.served += served
        self.service.gate.release()


class GatedStream(StreamingResponse):
    """A stream that gives back its turn however it ends (done, error, disconnect)."""

    def __init__(self, turn: Turn, content, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.turn = turn

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.turn.finished:  # the client went before the end
                self.turn.service.disconnects += 1
            self.turn.finish()


async def take_turn(service, first: bool = False) -> None:
    """Wait for the gate (`first`: ahead of those waiting); a full queue is a 503 with Retry-After."""
    try:
        await service.gate.acquire(first=first)
    except QueueFull:
        raise ApiError(503, f"the server is busy: {service.gate.waiting} requests already wait; retry later",
                       kind="server_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None


async def answer(service, request: Request, shape, model_id: str, messages: list, fields: dict,
                 schema: Optional[dict], stream: bool, tools: Sequence = ()):
    """Run `messages` (llm's) on `model_id` with the request's engine `fields` (the plugin's
    options) and `tools` (llm `Tool`s), and answer in `shape`."""
    await take_turn(service)
    service.keep_loaded()
    try:
        options = service.runtime.for_request(fields)  # now: a config change made while it waited applies
        options.setdefault("max_batch", service.gate.capacity)  # the requests it admits at once may batch
        run = Run(model_id, messages, options, schema, tools).start()
    except BaseException:
        service.gate.release()
        raise
    service.model_id = model_id
    turn = Turn(service, run)
    # A client that goes away cancels the run; once a stream has started, the
    # streaming response watches for that itself.
    watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(service, request, run))
    try:
        events = turn.run.events()
        first = await _first(events)  # a load or prompt error is still an HTTP error
        if stream:
            watcher.cancel()
            return GatedStream(turn, _stream(service, turn, events, first, shape), media_type=shape.media_type)
        return await _whole(service, turn, events, first, shape)
    except Exception as e:
        turn.finish()
        raise error_for(e) from None
    except BaseException:
        turn.finish()
        raise
    finally:
        watcher.cancel()


async def _whole(service, turn: Turn, events, first, shape) -> dict:
    reply = Reply()
    try:
        async for kind, value in _chain(first, events):
            reply.add(kind, value)
    finally:
        turn.finish(served=not turn.run.cancelled)
    service.replies.remember(reply)
    return shape.whole(reply)


async def _stream(service, turn: Turn, events, first, shape):
    reply = Reply()
    try:
        for frame in shape.opening():
            yield frame
        async for kind, value in _chain(first, events):
            reply.add(kind, value)
            if kind == "done":
                break
            for frame in shape.delta(kind, value):
                yield frame
        service.replies.remember(reply)
        turn.finish(served=True)
        for frame in shape.closing(reply):
            yield frame
    except Exception as e:  # the status line is sent: the error goes in the stream
        for frame in shape.failure(error_for(e)):
            yield frame


async def _cancel_on_disconnect(service, request: Request, run: Run) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    service.disconnects += 1
    run.cancel()


async def _first(events):
    try:
        return await events.__anext__()
    except StopAsyncIteration:  # pragma: no cover - a run always ends with "done"
        return ("done", Result())


async def _chain(first, events):
    yield first
    if first[0] == "done":
        return
    async for item in events:
        yield item
