"""What every API's reply shape gives turns.py, and the server-sent events they write.

A shape lays out what the reply core said in one API's terms, and nothing else (it
stores nothing: what a route keeps of a reply, it keeps through `turns.answer`'s `done`):
turns.py runs the turn and calls it. Not streamed, the reply is `whole(transcript)`; streamed, it
is `opening()`, a `delta(event)` per event, then `closing(transcript)`, or `failure(error)`
once the stream has started and something goes wrong; while the first token is awaited
(a long prefill), `keepalive()` every few seconds, where the API has such a frame.
"""

from __future__ import annotations

import json
from typing import Optional, Protocol

from ..reply.events import Event
from .errors import ApiError
from .transcript import Transcript

KEEPALIVE = ": waiting for the first token\n\n"  # an SSE comment: clients skip it
DONE = "data: [DONE]\n\n"  # OpenAI's end of a stream


class Shape(Protocol):
    media_type: str  # of the stream

    def whole(self, transcript: Transcript) -> dict:
        """The body of a reply that is not streamed."""

    def opening(self) -> list[str]:
        """The stream's first frames, before any event."""

    def delta(self, event: Event) -> list[str]:
        """The frames of one event of the reply."""

    def closing(self, transcript: Transcript) -> list[str]:
        """The stream's last frames, once the reply has ended."""

    def failure(self, error: ApiError) -> list[str]:
        """The frames that end a stream that went wrong after it started."""

    def keepalive(self) -> Optional[str]:
        """A frame that says the reply is coming; None where the API has none."""


def sse(data: dict) -> str:
    """A server-sent event of data alone (OpenAI's chunks)."""
    return f"data: {json.dumps(data)}\n\n"


def sse_event(kind: str, data: dict) -> str:
    """A named server-sent event whose data says its type too (Anthropic's, the Responses API's)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
