"""One generation request through the gate, answered in any API's shape.

Every API (OpenAI's chat completions and completions, the Responses API, Anthropic's
Messages, Ollama's chat and generate) builds one request record (`Asked`: its body,
conversation, options, tools, schema, shape, keep_alive) and hands it to one pipeline
(`answer`): accept its fields, find its model, make its messages, wait for the turn,
start the reply core with the runtime parameters of that moment, give the whole reply or
stream it, and time the model's keep_alive from the reply's end. The API's shape (a
`shape.Shape`: openai/, responses/, anthropic/ and ollama/shapes.py) only lays out what
the core said.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..options.settings import Options
from ..prompt.messages import raw_message
from ..reply.build import Ask
from ..reply.core import AsyncReply, count_tokens
from ..reply.events import Finished
from .conversation import llm_chain
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


class Host(Protocol):
    """What the pipeline asks of the server whose gate it runs (service.Service), and all
    of it: its request policy (policy.RequestPolicy: fields, model names), the models it
    hosts (hosting.Hosting: a request holds its model, whose keep_alive counts from the
    reply's end), the turns, the runtime parameters of the moment a turn comes, and the
    replies it gave (reply_memory.ReplyMemory)."""

    policy: Any
    hosting: Any
    turns: Turns
    runtime: Any
    replies: Any


@dataclass
class Asked:
    """One generation request in the server's terms, whatever API it came by: the record
    each route builds for `answer` (and `count`)."""

    body: Any  # the request body: its unused fields named, its `model`, `stream` and keep_alive read
    shape: Callable[[str], Shape]  # the reply's layout, for the model id that answers
    chat: list = field(default_factory=list)  # conversation.ChatMessage, in order
    raw: Optional[str] = None  # or a prompt encoded without the chat template
    fields: dict = field(default_factory=dict)  # the plugin options it sets
    tools: Sequence[dict] = ()  # function specs
    schema: Optional[dict] = None  # the JSON schema the reply follows
    grammar: Optional[tuple[str, str]] = None  # or the grammar it follows
    suffix: Optional[str] = None  # the text the reply fills up to
    ignored: Sequence[str] = ()  # what else it gave that nothing acts on (a hosted tool, a billing line)
    spelled: Mapping[str, str] = field(default_factory=dict)  # its own names for the plugin's thinking fields
    done: Optional[Callable[[Transcript, Shape], None]] = None  # once the reply is complete, before its last frames

    @property
    def stream(self) -> bool:
        return bool(getattr(self.body, "stream", False))

    def keep_seconds(self) -> Optional[float]:
        """How long its model stays loaded after the reply (keep_alive.KeepAlive)."""
        return self.body.keep_seconds() if hasattr(self.body, "keep_seconds") else None


class Turn:
    """A request's hold on the gate, taken by `take` and given back by `finish`, once,
    however the request ends; the gate is acquired and released nowhere else. A turn that
    runs a reply (`run`) cancels it on finishing if it is still going, and its `Turns`
    knows it until then, to end it when the server stops (`cancel`); `ended` is called as
    it finishes (the pipeline times the model's keep_alive there)."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns
        self.reply: Optional[AsyncReply] = None
        self.ended: Optional[Callable[[], None]] = None  # called once it finishes (the model's keep_alive)
        self._done = False
        self._gone = False

    @classmethod
    async def take(cls, turns: Turns, request: Optional[Request] = None) -> Turn:
        """Wait for the gate; a full queue is a 503 with
        Retry-After. A client that goes away while it waits (`request` given) leaves the
        queue at once, rather than holding a place until its turn comes."""
        waiting = asyncio.ensure_future(turns.gate.acquire())
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
        if self.ended is not None:
            self.ended()


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


async def answer(service: Host, request: Request, asked: Asked):
    """The one pipeline: accept the request's fields, find its model, make its messages,
    hold the model and wait for the turn, run the reply core, give the reply whole or
    streamed, and from its end (finished, cut or cancelled) time the model's keep_alive.
    `asked.done(transcript, shape)` is called once the reply is complete and laid out,
    before its last frames are sent (the Responses API stores the response then)."""
    model_id, messages = await _prepared(service, request, asked)
    record(request, model=model_id)
    done = _recorded(request, asked.done)
    shape = asked.shape(model_id)
    held = service.hosting.hold(model_id, asked.keep_seconds())
    try:
        turn = await Turn.take(service.turns, request=request)
    except BaseException:
        held.end()
        raise
    turn.ended = held.end
    try:
        if service.turns.stopping:
            raise _stopping()
        # now: a config change made while it waited applies
        options = service.runtime.for_request(asked.fields, service.hosting.path_of(model_id))
        options.setdefault("max_batch", service.turns.gate.capacity)  # the requests it admits at once may batch
        ask = Ask(service.policy.name_of(model_id), messages, Options.model_validate(options), asked.tools,
                  asked.schema, asked.grammar, asked.suffix)
    except Exception as e:
        turn.finish()
        raise error_for(e) from None
    turn.run(AsyncReply(ask))
    # A client that goes away cancels the reply; once a stream has started, the
    # streaming response watches for that itself.
    watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(turn, request))
    events = turn.reply.events()
    try:
        first = asyncio.ensure_future(anext(events, None))
        if asked.stream:  # a load or prompt error is still an HTTP error, unless the prefill runs long
            await asyncio.wait({first}, timeout=KEEPALIVE_SECONDS if shape.keepalive() else None)
            if first.done():
                first.result()  # raises what it raised
            watcher.cancel()
            record(request, capped=turn.reply.capped)  # known once the first token came (the header says so)
            return GatedStream(turn, _stream(service, turn, events, first, shape, done), media_type=shape.media_type)
        body = await _whole(service, turn, events, await first, shape, done)
        record(request, capped=turn.reply.capped)
    except Exception as e:
        turn.finish()
        raise error_for(e) from None
    except BaseException:
        turn.finish()
        first.cancel()
        raise
    finally:
        watcher.cancel()
    if held.unloading is not None:  # keep_alive 0: unloaded before the reply is given
        await held.unloading
    return body


async def count(service: Host, request: Request, asked: Asked) -> int:
    """The prompt's tokens as `answer` would render it, without a turn (nothing generates)."""
    model_id, messages = await _prepared(service, request, asked)
    try:
        options = Options.model_validate(service.runtime.for_request(asked.fields, service.hosting.path_of(model_id)))
        return await count_tokens(Ask(service.policy.name_of(model_id), messages, options, asked.tools))
    except Exception as e:
        raise error_for(e) from None


async def _prepared(service: Host, request: Request, asked: Asked) -> tuple[str, list]:
    """(The model id, llm's messages) of `asked`, its unused fields named."""
    policy = service.policy
    policy.accept(request, asked.body)
    policy.ignore(request, list(asked.ignored))
    model_id = policy.model_for(asked.body.model)
    messages = [raw_message(asked.raw)] if asked.raw is not None else \
        await llm_chain(service, model_id, asked.chat)
    policy.unswitched(request, model_id, asked.fields, asked.spelled)
    return model_id, messages


async def _whole(service: Host, turn: Turn, events, first, shape: Shape, done) -> dict:
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
    service.replies.remember(transcript)
    body = shape.whole(transcript)
    if done is not None:
        done(transcript, shape)
    return body


async def _stream(service: Host, turn: Turn, events, first: asyncio.Future, shape: Shape, done):
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
        service.replies.remember(transcript)
        turn.finish(served=True)
        frames = shape.closing(transcript)
        if done is not None:
            done(transcript, shape)
        for frame in frames:
            yield frame
    except Exception as e:  # the status line is sent: the error goes in the stream
        for frame in shape.failure(error_for(e)):
            yield frame


def _recorded(request: Request, done: Optional[Callable[[Transcript, Shape], None]]) -> Callable[[Transcript, Shape], None]:
    """`done`, after the finished reply's outcome is put on the request's record (its log line)."""
    def finished(transcript: Transcript, shape: Shape) -> None:
        record(request, outcome=transcript.outcome)
        if done is not None:
            done(transcript, shape)

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
