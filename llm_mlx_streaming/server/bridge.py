"""One request through the plugin's own prompt path, on a thread, events to the loop.

The server answers with exactly what `llm -m ...` would: it calls the registered llm
model with the request's messages and options, so resolution, the engine's locked
"load and generate", `<think>` splitting and the figures are the plugin's. The llm
response is a blocking iterator, so it is driven on a thread of its own and each event
is handed to the event loop; the thread marks itself as the server's so the plugin does
not route the prompt back to this very server.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from .client import serving_thread


@dataclass
class Result:
    """What a finished (or cut) generation leaves behind."""

    stats: dict = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    resolved_model: Optional[str] = None
    text_events: int = 0  # events seen, a token count for a reply cut short

    @property
    def prompt_tokens(self) -> int:
        return int(self.stats.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        generated = self.stats.get("generated_tokens")
        return int(generated) if generated is not None else self.text_events

    @property
    def finish_reason(self) -> Optional[str]:
        return self.stats.get("finish_reason")


class Run:
    """A prompt running on its own thread; `events()` yields ("text"|"reasoning", chunk)
    and ends with ("done", Result); `cancel()` stops it at its next token."""

    def __init__(self, model_id: str, messages: list, options: dict, schema: Optional[dict] = None) -> None:
        self.model_id, self.messages, self.options, self.schema = model_id, messages, options, schema
        self.result = Result()
        self.finished = threading.Event()
        self._cancel = threading.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queue: Optional[asyncio.Queue] = None

    def start(self) -> "Run":
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        threading.Thread(target=self._work, name="mlx-stream-request", daemon=True).start()
        return self

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        while True:
            kind, value = await self._queue.get()
            if kind == "error":
                raise value
            yield kind, value
            if kind == "done":
                return

    def _put(self, kind: str, value) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))
        except RuntimeError:
            pass  # the loop has closed: the server is stopping

    def _work(self) -> None:
        import llm

        from ..prompting import METADATA_KEY

        serving_thread(True)
        try:
            response = llm.get_model(self.model_id).prompt(messages=self.messages, schema=self.schema,
                                                           **self.options)
            events = response.stream_events()
            try:
                for event in events:
                    tokens = ((event.provider_metadata or {}).get(METADATA_KEY) or {}).get("tokens")
                    if tokens is not None:
                        self.result.tokens = list(tokens)
                    if event.chunk and event.type in ("text", "reasoning"):
                        self.result.text_events += 1
                        self._put(event.type, event.chunk)
                    if self._cancel.is_set():
                        break
            finally:
                events.close()  # a cut run: closing the plugin's generator cancels the engine's
            if not self._cancel.is_set():
                self.result.stats = dict(response.response_json or {})
                self.result.resolved_model = response.resolved_model
            self._put("done", self.result)
        except Exception as e:
            self._put("error", e)
        finally:
            self.finished.set()
