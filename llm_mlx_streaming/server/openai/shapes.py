"""The OpenAI layouts of a reply: chat or text, one body or server-sent events.

Both carry the `mlx_stream` extension (the engine's figures, the reply's token ids, the
checkpoint) so `llm` can log exactly what an in-process run logs.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from ...reply.events import CallArguments, CallBegins, Event, Outcome
from ..shape import DONE, KEEPALIVE, sse
from ..transcript import Transcript, extension
from .tools import reply_calls


class OpenAIShape:
    """How one OpenAI route's chunks and bodies look."""

    media_type = "text/event-stream"

    def __init__(self, model_id: str, body) -> None:
        self.model = model_id
        self.created = int(time.time())
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def _base(self, choices: list) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}

    @staticmethod
    def usage(outcome: Outcome) -> dict:
        return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}

    def closing(self, transcript: Transcript) -> list[str]:
        outcome = transcript.outcome
        choice = {"index": 0, **self.last_choice, "finish_reason": self.finish(outcome), **self.logprobs(outcome)}
        frames = [sse({**self._base([choice]), "mlx_stream": extension(outcome)})]
        if self.include_usage:
            frames.append(sse({**self._base([]), "usage": self.usage(outcome)}))
        return frames + [DONE]

    def failure(self, error) -> list[str]:
        return [sse(error.openai_body()), DONE]

    @staticmethod
    def keepalive() -> str:
        return KEEPALIVE

    @staticmethod
    def finish(outcome: Outcome) -> Optional[str]:
        return outcome.finish_reason


class ChatCompletionShape(OpenAIShape):
    prefix, chunk_object = "chatcmpl", "chat.completion.chunk"
    last_choice = {"delta": {}}

    @staticmethod
    def logprobs(outcome: Outcome) -> dict:
        return _chat_logprobs(outcome)

    def __init__(self, model_id: str, body) -> None:
        super().__init__(model_id, body)
        self.calls: dict[str, int] = {}  # tool call id -> its index in the reply

    def opening(self) -> list[str]:
        return [sse(self._base([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))]

    def delta(self, event: Event) -> list[str]:
        if isinstance(event, CallBegins):  # a call begins: its id and name
            index = self.calls.setdefault(event.id, len(self.calls))
            delta = {"tool_calls": [{"index": index, "id": event.id, "type": "function",
                                     "function": {"name": event.name, "arguments": ""}}]}
        elif isinstance(event, CallArguments):  # a piece of its arguments
            delta = {"tool_calls": [{"index": self.calls[event.id], "function": {"arguments": event.text}}]}
        else:
            delta = {"reasoning_content": event.text} if event.kind == "reasoning" else {"content": event.text}
        return [sse(self._base([{"index": 0, "delta": delta, "finish_reason": None}]))]

    @staticmethod
    def finish(outcome: Outcome) -> Optional[str]:
        """OpenAI's finish_reason: a reply that ends in tool calls ends for them."""
        return "tool_calls" if outcome.ended_for_calls else outcome.finish_reason

    def whole(self, transcript: Transcript) -> dict:
        outcome = transcript.outcome
        calls = outcome.complete_calls()
        message = {"role": "assistant", "content": transcript.text or (None if calls else "")}
        if transcript.reasoning:
            message["reasoning_content"] = transcript.reasoning
        if calls:
            message["tool_calls"] = reply_calls(calls)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": self.finish(outcome),
                             **self.logprobs(outcome)}],
                "usage": self.usage(outcome), "mlx_stream": extension(outcome)}


class CompletionShape(OpenAIShape):
    prefix, chunk_object = "cmpl", "text_completion"
    last_choice = {"text": ""}

    @staticmethod
    def logprobs(outcome: Outcome) -> dict:
        return _text_logprobs(outcome)

    def opening(self) -> list[str]:
        return [sse(self._base([{"index": 0, "text": "", "finish_reason": None}]))]

    def delta(self, event: Event) -> list[str]:
        text = event.text if event.kind == "text" else ""
        return [sse(self._base([{"index": 0, "text": text, "finish_reason": None}]))]

    def whole(self, transcript: Transcript) -> dict:
        outcome = transcript.outcome
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": transcript.text, "finish_reason": outcome.finish_reason,
                             **self.logprobs(outcome)}],
                "usage": self.usage(outcome), "mlx_stream": extension(outcome)}


def _chat_logprobs(outcome: Outcome) -> dict:
    """A chat choice's `logprobs`, when they were asked for."""
    entries = outcome.logprobs
    if entries is None:
        return {}
    return {"logprobs": {"content": [{**_with_bytes(e), "top_logprobs": [_with_bytes(t) for t in e["top_logprobs"]]}
                                     for e in entries]}}


def _with_bytes(entry: dict) -> dict:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": list(entry["token"].encode())}


def _text_logprobs(outcome: Outcome) -> dict:
    """A completion choice's `logprobs` (the legacy layout), when they were asked for."""
    entries = outcome.logprobs
    if entries is None:
        return {}
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"logprobs": {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                         "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                         "text_offset": offsets}}
