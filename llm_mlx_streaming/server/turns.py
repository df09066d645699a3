"""One generation request through the gate, answered in any API's shape.

Every API (OpenAI's chat completions and completions, the Responses API, Anthropic's
Messages, Ollama's chat and generate) runs the same path: wait for the turn, start the
reply core with the runtime parameters of that moment, then give the whole reply or
stream it. The API's shape (a `shape.Shape`: openai/, responses/, anthropic/ and
ollama/shapes.py) only lays out what the core said.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Mapping, Optional, Protocol, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..options.settings import Options
from ..values import EFFORTS
from ..reply.build import Ask
from ..reply.core import AsyncReply, count_tokens
from ..reply.events import Finished
from .errors import ApiError, error_for
from .gate import Gate, QueueFull
from .request_log import record
from .shape import Shape
from .transcript import Transcript

RETRY_AFTER_SECONDS = 2
KEEPALIVE_SECONDS = 5.0  # a stream waiting for its first token (a long prefill) says so this often


class Turns:
    """The gate and everything that goes through it: the turns running a reply (each
    ended by `stop`, when the server stops), whether the server is stopping, and the
    figures of the requests served and of the clients that went before their reply was
    complete. The gate is taken and given back only through `Turn`."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.running: set[Turn] = set()  # the turns whose reply is in flight
        self.stopping = False
        self.served = 0
        self.disconnects = 0

    def stop(self) -> None:
        """No turn starts a reply any more, and every reply in flight ends now."""
        self.stopping = True
        for turn in list(self.running):
            turn.cancel()


class GateOwner(Protocol):
    """What turns.py asks of the server whose gate it runs (service.Service), and all of
    it: the turns (`Turns`), the model's checkpoint name, whether its template has a
    thinking switch, the fields a request gave that were not acted on (`ignore`), the
    keep_alive timer (`unload_after`), a request's options at the moment its turn comes
    (`request_options`), the model a reply started on (`started`), the replies given
    (`remember`)."""

    turns: Turns

    def name_of(self, model_id: str) -> Optional[str]: ...

    def thinks(self, model_id: str) -> bool: ...

    def ignore(self, request: Request, names: list[str]) -> None: ...

    def unload_after(self, model_id: str, seconds: Optional[float]) -> None: ...

    def request_options(self, fields: dict) -> dict: ...

    def started(self, model_id: str) -> None: ...

    def remember(self, transcript: Transcript) -> None: ...


class Turn:
    """A request's hold on the gate, taken by `take` and given back by `finish`, once,
    however the request ends; the gate is acquired and released nowhere else. A turn that
    runs a reply (`run`) cancels it on finishing if it is still going, and its `Turns`
    knows it until then, to end it when the server stops (`cancel`). `async with`
    finishes it at the block's end (a load, an unload)."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns
        self.reply: Optional[AsyncReply] = None
        self._done = False
        self._gone = False

    @classmethod
    async def take(cls, turns: Turns, first: bool = False, request: Optional[Request] = None) -> Turn:
        """Wait for the gate (`first`: ahead of those waiting); a full queue is a 503 with
        Retry-After. A client that goes away while it waits (`request` given) leaves the
        queue at once, rather than holding a place until its turn comes."""
        waiting = asyncio.ensure_future(turns.gate.acquire(first=first))
        gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        try:
            await asyncio.wait({waiting} | ({gone} if gone else set()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiting.done():
                waiting.cancel()  # the gate passes on a turn that came as it went
                await asyncio.gather(waiting, return_exceptions=True)
            if gone is not None:
                gone.cancel()
        if waiting.cancelled():
            turns.disconnects += 1
            raise ApiError(499, "the client went away while its request waited for its turn",
                           kind="invalid_request_error", code="client_closed")
        try:
            waiting.result()
        except QueueFull:
            raise ApiError(503, f"the server is busy: {turns.gate.waiting} requests already wait; retry later",
                           kind="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        return cls(turns)

    def run(self, reply: AsyncReply) -> AsyncReply:
        self.reply = reply
        self.turns.running.add(self)
        return reply

    def cancel(self) -> None:
        """End the reply the turn runs (the turn is finished as its request ends)."""
        if self.reply is not None:
            self.reply.cancel()

    @property
    def finished(self) -> bool:
        return self._done

    def client_gone(self) -> None:
        """Its client went before the reply was complete: counted once, whichever watcher saw it."""
        if not self._gone:
            self._gone = True
            self.turns.disconnects += 1

    def finish(self, served: bool = False) -> None:
        if self._done:
            return
        self._done = True
        if self.reply is not None:
            self.reply.cancel()  # nothing once it has ended
            self.turns.running.discard(self)
        self.turns.served += served
        self.turns.gate.release()

    async def __aenter__(self) -> Turn:
        return self

    async def __aexit__(self, *exc) -> None:
        self.finish()


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
                self.turn.client_gone()
            self.turn.finish()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def unswitched(service: GateOwner, request: Request, model_id: str, fields: dict,
               spelled: Mapping[str, str] = {}) -> None:
    """Whether the request's thinking fields apply, decided here for every API (`spelled`:
    the request's own names for the plugin's, named back so). A thinking switch for a model
    whose template has none is accepted and named, as clients send it to every model, and
    so is a reasoning effort no template reads (the Responses API takes any). A budget
    stays: a model that always reasons (its generation prompt opens the block) is held to
    it, and one that never does has nothing for it to close (reply/build.py)."""
    named = [spelled.get(name, name) for name in ("thinking", "reasoning_effort")]
    if fields.get("reasoning_effort") not in (None, *EFFORTS):
        del fields["reasoning_effort"]
        service.ignore(request, named[1:])
    if not service.thinks(model_id):
        if fields.pop("thinking", None):
            service.ignore(request, named[:1])
        if fields.pop("reasoning_effort", None) not in (None, "none", "minimal"):
            service.ignore(request, named[1:])


async def count(service: GateOwner, request: Request, model_id: str, messages: list, fields: dict,
                tools: Sequence[dict], spelled: Mapping[str, str] = {}) -> int:
    """The prompt's tokens as `answer` would render it, without a turn (nothing generates)."""
    unswitched(service, request, model_id, fields, spelled)
    try:
        options = Options.model_validate(service.request_options(fields))
        return await count_tokens(Ask(service.name_of(model_id), messages, options, tools))
    except Exception as e:
        raise error_for(e) from None


async def answer(service: GateOwner, request: Request, shape: Shape, model_id: str, messages: list, fields: dict,
                 schema: Optional[dict], stream: bool, tools: Sequence[dict] = (),
                 grammar: Optional[tuple[str, str]] = None, suffix: Optional[str] = None,
                 spelled: Mapping[str, str] = {}, done: Optional[Callable[[Transcript], None]] = None):
    """Answer `messages` (llm's) on `model_id` with the request's `fields` (its
    `plugin_options()`), `tools` (function specs), the `schema` or `grammar` the reply
    must follow and the `suffix` it fills up to, in `shape`; `done(transcript)` is called
    once the reply is complete and laid out, before its last frames are sent (the
    Responses API stores the response then)."""
    unswitched(service, request, model_id, fields, spelled)
    record(request, model=model_id)
    done = _recorded(request, done)
    turn = await Turn.take(service.turns, request=request)
    service.unload_after(model_id, None)  # the server's keep_alive; a request's own keep_alive follows
    try:
        if service.turns.stopping:
            raise _stopping()
        options = service.request_options(fields)  # now: a config change made while it waited applies
        options.setdefault("max_batch", service.turns.gate.capacity)  # the requests it admits at once may batch
        ask = Ask(service.name_of(model_id), messages, Options.model_validate(options), tools, schema, grammar,
                  suffix)
    except Exception as e:
        turn.finish()
        raise error_for(e) from None
    service.started(model_id)
    turn.run(AsyncReply(ask))
    # A client that goes away cancels the reply; once a stream has started, the
    # streaming response watches for that itself.
    watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(turn, request))
    events = turn.reply.events()
    try:
        first = asyncio.ensure_future(anext(events, None))
        if stream:  # a load or prompt error is still an HTTP error, unless the prefill runs long
            await asyncio.wait({first}, timeout=KEEPALIVE_SECONDS if shape.keepalive() else None)
            if first.done():
                first.result()  # raises what it raised
            watcher.cancel()
            record(request, capped=turn.reply.capped)  # known once the first token came (the header says so)
            return GatedStream(turn, _stream(service, turn, events, first, shape, done), media_type=shape.media_type)
        body = await _whole(service, turn, events, await first, shape, done)
        record(request, capped=turn.reply.capped)
        return body
    except Exception as e:
        turn.finish()
        raise error_for(e) from None
    except BaseException:
        turn.finish()
        first.cancel()
        raise
    finally:
        watcher.cancel()


async def _whole(service: GateOwner, turn: Turn, events, first, shape: Shape, done) -> dict:
    transcript = Transcript()
    ended = False
    try:
        async for event in _chain(first, events):
            transcript.add(event)
            ended = isinstance(event, Finished)
    finally:
        turn.finish(served=not turn.reply.cancelled)
    if not ended:  # cancelled: the client has gone, or the server is stopping
        raise _stopping()
    service.remember(transcript)
    body = shape.whole(transcript)
    if done is not None:
        done(transcript)
    return body


async def _stream(service: GateOwner, turn: Turn, events, first: asyncio.Future, shape: Shape, done):
    """The stream's frames; until the first event comes, a keep-alive every
    KEEPALIVE_SECONDS, so that no client gives up during a long prefill."""
    transcript = Transcript()
    try:
        for frame in shape.opening():
            yield frame
        while not first.done():
            await asyncio.wait({first}, timeout=KEEPALIVE_SECONDS)
            if not first.done():
                yield shape.keepalive()
        async for event in _chain(first.result(), events):
            transcript.add(event)
            if isinstance(event, Finished):
                break
            for frame in shape.delta(event):
                yield frame
        else:  # cancelled: the client has gone, or the server is stopping
            raise _stopping()
        service.remember(transcript)
        turn.finish(served=True)
        frames = shape.closing(transcript)
        if done is not None:
            done(transcript)
        for frame in frames:
            yield frame
    except Exception as e:  # the status line is sent: the error goes in the stream
        for frame in shape.failure(error_for(e)):
            yield frame


def _recorded(request: Request, done: Optional[Callable[[Transcript], None]]) -> Callable[[Transcript], None]:
    """`done`, after the finished reply's outcome is put on the request's record (its log line)."""
    def finished(transcript: Transcript) -> None:
        record(request, outcome=transcript.outcome)
        if done is not None:
            done(transcript)

    return finished


def _stopping() -> ApiError:
    return ApiError(503, "the server is stopping; the reply was cut short", kind="server_error",
                    code="server_stopping")


async def _cancel_on_disconnect(turn: Turn, request: Request) -> None:
    await _disconnected(request)
    turn.client_gone()
    turn.reply.cancel()


async def _chain(first, events):
    if first is None:
        return
    yield first
    async for event in events:
        yield event
