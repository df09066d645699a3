"""One request through the plugin's own prompt path, as a task on the event loop.

The server answers with exactly what `llm -m ...` would: it prompts the registered llm
model (its async twin) with the request's messages and options, so resolution, the
engine's locked "load and generate", `<think>` splitting and the figures are the
plugin's. `no_server` keeps the plugin from routing the prompt back to this very
server. Cancelling the task closes the model's stream, which cancels the engine's
generation at its next token.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence
from ..messages import METADATA_KEY


@dataclass
class Result:
    """What a finished (or cut) generation leaves behind."""

    stats: dict = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    resolved_model: Optional[str] = None
    text_events: int = 0  # events seen, a token count for a reply cut short
    tool_calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments" (JSON text)}

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

    def complete_calls(self) -> list[dict]:
        """The calls whose arguments came whole, as {"id", "name", "input": dict} (a call
        cut short is in the reply's text as the markup the model wrote)."""
        out = []
        for call in self.tool_calls:
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except json.JSONDecodeError:
                continue
            if isinstance(arguments, dict):
                out.append({"id": call["id"], "name": call["name"], "input": arguments})
        return out


class Reply:
    """What a run said, gathered as it streams: the text, the reasoning, the result."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self.result = Result()

    def add(self, kind: str, value) -> None:
        if kind == "done":
            self.result = value
        elif kind in ("text", "reasoning"):  # the result holds the tool calls
            (self._reasoning if kind == "reasoning" else self._text).append(value)

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.result.finish_reason


class Run:
    """A prompt running as a task; `events()` yields ("text"|"reasoning", chunk),
    ("tool_call", {"id", "name"}) when a call begins and ("tool_arguments", {"id",
    "text"}) for each piece of its arguments (JSON text, as generated) as the reply
    comes, and ends with ("done", Result) (also when cancelled); `cancel()` stops it.

    `tools` are llm `Tool`s the model may call (not executed here: the calls are the
    reply); `options` may hold `tool_choice` ("auto", "none", "required" or a tool's
    name) and `parallel_tool_calls`, the plugin's options of those names."""

    def __init__(self, model_id: str, messages: list, options: dict, schema: Optional[dict] = None,
                 tools: Sequence = ()) -> None:
        self.model_id, self.messages, self.options, self.schema = model_id, messages, options, schema
        self.tools = list(tools)
        self.result = Result()
        self.cancelled = False
        self._task: Optional[asyncio.Task] = None
        self._queue: Optional[asyncio.Queue] = None

    def start(self) -> "Run":
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._work())
        return self

    @property
    def finished(self) -> bool:
        return self._task is not None and self._task.done()

    def cancel(self) -> None:
        if not self.finished:
            self.cancelled = True
            self._task.cancel()

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        while True:
            kind, value = await self._queue.get()
            if kind == "error":
                raise value
            yield kind, value
            if kind == "done":
                return

    async def _put(self, kind: str, value) -> None:
        self._queue.put_nowait((kind, value))

    async def _work(self) -> None:
        import llm

        try:
            model = llm.get_async_model(self.model_id)
            response = model.prompt(messages=self.messages, schema=self.schema, tools=self.tools or None,
                                    no_server=True, **self.options)
            calls: dict = {}  # tool call id -> the call in the result
            async for event in response.astream_events():
                tokens = ((event.provider_metadata or {}).get(METADATA_KEY) or {}).get("tokens")
                if tokens is not None:
                    self.result.tokens = list(tokens)
                if event.chunk and event.type in ("text", "reasoning"):
                    self.result.text_events += 1
                    await self._put(event.type, event.chunk)
                elif event.type == "tool_call_name":
                    calls[event.tool_call_id] = {"id": event.tool_call_id, "name": event.chunk, "arguments": ""}
                    self.result.tool_calls.append(calls[event.tool_call_id])
                    await self._put("tool_call", {"id": event.tool_call_id, "name": event.chunk})
                elif event.type == "tool_call_args" and event.chunk:
                    calls[event.tool_call_id]["arguments"] += event.chunk
                    await self._put("tool_arguments", {"id": event.tool_call_id, "text": event.chunk})
            self.result.stats = dict(response.response_json or {})
            self.result.resolved_model = response.resolved_model
            await self._put("done", self.result)
        except asyncio.CancelledError:
            self._queue.put_nowait(("done", self.result))  # whoever still reads gets an end
            raise
        except Exception as e:
            self._queue.put_nowait(("error", e))
