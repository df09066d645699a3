"""Ollama's layouts of a reply: one JSON body, or NDJSON lines (one object a line, the
last with `done: true`, the stop reason and the counts and durations).

/api/chat puts the reply in `message` (content, thinking, tool_calls), /api/generate
in `response` and `thinking`. The `mlx_stream` extension carries the engine's figures
and the reply's token ids.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Optional

from ...reply.events import CallArguments, CallBegins, Event, Outcome, ToolCall
from ..transcript import Transcript, extension

NS = 1_000_000_000


def stamp(seconds: float) -> str:
    """A time.time() as Ollama writes times."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def now() -> str:
    return stamp(time.time())


def line(data: dict) -> str:
    return json.dumps(data) + "\n"


def error_body(error) -> dict:
    """An errors.ApiError as Ollama's error object."""
    return {"error": error.message}


def figures(outcome: Outcome) -> dict:
    """Ollama's counts and durations (nanoseconds), from the engine's figures: as Ollama
    counts them, prompt_eval_count is the whole prompt and prompt_eval_cached_count the
    part of it the KV cache held."""
    total = int(outcome.seconds * NS)
    prompt = min(total, int(outcome.first_token_seconds * NS))
    out = {"total_duration": total, "load_duration": 0, "prompt_eval_count": outcome.prompt_tokens,
           "prompt_eval_cached_count": outcome.cached_tokens, "prompt_eval_duration": prompt,
           "eval_count": outcome.completion_tokens, "eval_duration": total - prompt, "mlx_stream": extension(outcome)}
    if outcome.logprobs is not None:  # {token, logprob, top_logprobs}, as Ollama's
        out["logprobs"] = outcome.logprobs
    return out


def done_reason(outcome: Outcome) -> Optional[str]:
    return "length" if outcome.finish_reason == "length" else "stop"


def tool_calls(calls: list[ToolCall], first: int = 0) -> list[dict]:
    """Complete calls in Ollama's layout."""
    return [{"function": {"index": i, "name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls, first)]


class OllamaShape:
    media_type = "application/x-ndjson"

    def __init__(self, model: str) -> None:
        self.model = model

    def _base(self, **fields) -> dict:
        return {"model": self.model, "created_at": now(), **fields}

    def status(self, reason: str) -> dict:
        """The answer to a request that generates nothing (a load, an unload)."""
        return self._base(**self.empty(), done=True, done_reason=reason)

    def opening(self) -> list[str]:
        return []

    @staticmethod
    def keepalive() -> None:
        """None: every NDJSON line is an object a client parses, so there is no comment line."""
        return None

    def closing(self, transcript: Transcript) -> list[str]:
        outcome = transcript.outcome
        return [line(self._base(**self.empty(), done=True, done_reason=done_reason(outcome), **figures(outcome)))]

    def failure(self, error) -> list[str]:
        return [line({"error": error.message})]


class OllamaChatShape(OllamaShape):
    """Ollama streams a call whole: it is held until its arguments have come."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.calls = 0  # tool calls streamed so far
        self._call: Optional[dict] = None  # the call whose arguments are coming

    def empty(self) -> dict:
        return {"message": {"role": "assistant", "content": ""}}

    def delta(self, event: Event) -> list[str]:
        if isinstance(event, CallArguments):
            self._call["arguments"] += event.text
            return []
        frames = self._flush_call()
        if isinstance(event, CallBegins):
            self._call = {"id": event.id, "name": event.name, "arguments": ""}
            return frames
        if event.kind == "reasoning":
            message = {"role": "assistant", "content": "", "thinking": event.text}
        else:
            message = {"role": "assistant", "content": event.text}
        return frames + [line(self._base(message=message, done=False))]

    def _flush_call(self) -> list[str]:
        call, self._call = self._call, None
        try:
            arguments = json.loads(call["arguments"] or "{}") if call else None
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # none, or its markup came as text
            return []
        message = {"role": "assistant", "content": "",
                   "tool_calls": tool_calls([ToolCall(call["id"], call["name"], arguments)], self.calls)}
        self.calls += 1
        return [line(self._base(message=message, done=False))]

    def closing(self, transcript: Transcript) -> list[str]:
        complete = {call.id for call in transcript.outcome.complete_calls()}
        frames = self._flush_call() if self._call is not None and self._call["id"] in complete else []
        return frames + super().closing(transcript)

    def whole(self, transcript: Transcript) -> dict:
        outcome = transcript.outcome
        message = {"role": "assistant", "content": transcript.text}
        if transcript.reasoning:
            message["thinking"] = transcript.reasoning
        if calls := outcome.complete_calls():
            message["tool_calls"] = tool_calls(calls)
        return self._base(message=message, done=True, done_reason=done_reason(outcome), **figures(outcome))


class GenerateShape(OllamaShape):
    def empty(self) -> dict:
        return {"response": ""}

    def delta(self, event: Event) -> list[str]:
        fields = {"response": "", "thinking": event.text} if event.kind == "reasoning" else {"response": event.text}
        return [line(self._base(**fields, done=False))]

    def whole(self, transcript: Transcript) -> dict:
        outcome = transcript.outcome
        fields = {"response": transcript.text}
        if transcript.reasoning:
            fields["thinking"] = transcript.reasoning
        return self._base(**fields, done=True, done_reason=done_reason(outcome), **figures(outcome))
