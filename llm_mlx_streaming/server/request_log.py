"""One log line per finished request, and the header naming what a reply capped.

The one place that finishes replies (turns.py) records on the request's state the model
it ran on, the reply's outcome and the values the engine lowered (`record`); this ASGI
middleware, outside the routes, names those caps in the `x-mlx-stream-capped` header and,
once the response is sent, logs one line, the way uvicorn and Ollama log each request:
method, path, status, seconds, and for a reply its model and prompt, cached and generated
tokens. `llm mlxs serve` prints them on stderr (`--quiet`: not); a process that starts a
server without a handler for this logger prints nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..reply import caps

log = logging.getLogger(__name__)
CAPPED_HEADER = "x-mlx-stream-capped"
RECORD = "mlx_stream_request"  # the key of a request's record in its scope's state


def record(request, **fields: Any) -> None:
    """Put `fields` (model, outcome, capped) on the request's record."""
    request.scope.setdefault("state", {}).setdefault(RECORD, {}).update(fields)


def line(method: str, path: str, status: int, seconds: float, found: dict) -> str:
    """A finished request as the log shows it."""
    text = f"{method} {path} {status} {seconds:.2f}s"
    if found.get("model"):
        text += f" {found['model']}"
    outcome = found.get("outcome")
    if outcome is not None:
        text += (f" prompt {outcome.prompt_tokens} (cached {outcome.cached_tokens}) "
                 f"generated {outcome.completion_tokens}")
    capped = found.get("capped") or (outcome.capped if outcome is not None else {})
    if capped:
        text += " capped " + ", ".join(f"{name} {asked}->{given}" for name, (asked, given) in capped.items())
    return text


class RequestLog:
    """ASGI middleware: the capped header, then the request's log line once it has ended."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), [500]

        async def sent(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                capped = _found(scope).get("capped")
                if capped:
                    header = (CAPPED_HEADER.encode(), caps.header(capped).encode())
                    message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            if log.isEnabledFor(logging.INFO):
                log.info(line(scope.get("method", ""), scope.get("path", ""), status[0], time.monotonic() - start,
                              _found(scope)))


def _found(scope) -> dict:
    return (scope.get("state") or {}).get(RECORD) or {}
