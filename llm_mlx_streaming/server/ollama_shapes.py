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

from .bridge import Reply, Result

NS = 1_000_000_000


def stamp(seconds: float) -> str:
    """A time.time() as Ollama writes times."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def now() -> str:
    return stamp(time.time())


def line(data: dict) -> str:
    return json.dumps(data) + "\n"


def figures(result: Result) -> dict:
    """Ollama's counts and durations (nanoseconds), from the engine's figures."""
    total = int(float(result.stats.get("seconds") or 0) * NS)
    prompt = min(total, int(float(result.stats.get("ttft_seconds") or 0) * NS))
    out = {"total_duration": total, "load_duration": 0, "prompt_eval_count": result.prompt_tokens,
           "prompt_eval_duration": prompt, "eval_count": result.completion_tokens, "eval_duration": total - prompt,
           "mlx_stream": {"stats": result.stats, "tokens": result.tokens, "resolved_model": result.resolved_model}}
    if (logprobs := result.stats.get("logprobs")) is not None:  # {token, logprob, top_logprobs}, as Ollama's
        out["logprobs"] = logprobs
    return out


def done_reason(result: Result) -> Optional[str]:
    return "length" if result.finish_reason == "length" else "stop"


def tool_calls(calls: list[dict], first: int = 0) -> list[dict]:
    """Complete calls ({"name", "input"}) in Ollama's layout."""
    return [{"function": {"index": i, "name": c["name"], "arguments": c["input"]}} for i, c in enumerate(calls, first)]


class _Shape:
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

    def closing(self, reply: Reply) -> list[str]:
        return [line(self._base(**self.empty(), done=True, done_reason=done_reason(reply.result),
                                **figures(reply.result)))]

    def failure(self, error) -> list[str]:
        return [line({"error": error.message})]


class ChatShape(_Shape):
    """Ollama streams a call whole: it is held until its arguments have come."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.calls = 0  # tool calls streamed so far
        self._call: Optional[dict] = None  # the call whose arguments are coming

    def empty(self) -> dict:
        return {"message": {"role": "assistant", "content": ""}}

    def delta(self, kind: str, value) -> list[str]:
        if kind == "tool_arguments":
            self._call["arguments"] += value["text"]
            return []
        frames = self._flush_call()
        if kind == "tool_call":
            self._call = {**value, "arguments": ""}
            return frames
        if kind == "reasoning":
            message = {"role": "assistant", "content": "", "thinking": value}
        else:
            message = {"role": "assistant", "content": value}
        return frames + [line(self._base(message=message, done=False))]

    def _flush_call(self) -> list[str]:
        call, self._call = self._call, None
        complete = Result(tool_calls=[call]).complete_calls() if call else []
        if not complete:  # none, or cut short (its markup comes as text)
            return []
        message = {"role": "assistant", "content": "", "tool_calls": tool_calls(complete, self.calls)}
        self.calls += 1
        return [line(self._base(message=message, done=False))]

    def closing(self, reply: Reply) -> list[str]:
        return self._flush_call() + super().closing(reply)

    def whole(self, reply: Reply) -> dict:
        message = {"role": "assistant", "content": reply.text}
        if reply.reasoning:
            message["thinking"] = reply.reasoning
        if calls := reply.result.complete_calls():
            message["tool_calls"] = tool_calls(calls)
        return self._base(message=message, done=True, done_reason=done_reason(reply.result), **figures(reply.result))


class GenerateShape(_Shape):
    def empty(self) -> dict:
        return {"response": ""}

    def delta(self, kind: str, value) -> list[str]:
        fields = {"response": "", "thinking": value} if kind == "reasoning" else {"response": value}
        return [line(self._base(**fields, done=False))]

    def whole(self, reply: Reply) -> dict:
        fields = {"response": reply.text}
        if reply.reasoning:
            fields["thinking"] = reply.reasoning
        return self._base(**fields, done=True, done_reason=done_reason(reply.result), **figures(reply.result))
