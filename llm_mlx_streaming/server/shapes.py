"""The OpenAI layouts of a reply: chat or text, one body or server-sent events.

Both carry the `mlx_stream` extension (the engine's figures, the reply's token ids, the
checkpoint) so `llm` can log exactly what an in-process run logs.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from .bridge import Reply, Result
from .openai_tools import reply_calls


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


DONE = "data: [DONE]\n\n"


class Shape:
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
    def usage(result: Result) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens}

    @staticmethod
    def extension(result: Result) -> dict:
        return {"stats": result.stats, "tokens": result.tokens, "resolved_model": result.resolved_model}

    def closing(self, reply: Reply) -> list[str]:
        choice = {"index": 0, **self.last_choice, "finish_reason": self.finish(reply), **self.logprobs(reply.result)}
        frames = [sse({**self._base([choice]), "mlx_stream": self.extension(reply.result)})]
        if self.include_usage:
            frames.append(sse({**self._base([]), "usage": self.usage(reply.result)}))
        return frames + [DONE]

    def failure(self, error) -> list[str]:
        return [sse(error.response_body()), DONE]

    @staticmethod
    def finish(reply: Reply) -> Optional[str]:
        return reply.finish_reason


class ChatShape(Shape):
    prefix, chunk_object = "chatcmpl", "chat.completion.chunk"
    last_choice = {"delta": {}}

    @staticmethod
    def logprobs(result: Result) -> dict:
        return _chat_logprobs(result)

    def __init__(self, model_id: str, body) -> None:
        super().__init__(model_id, body)
        self.calls: dict[str, int] = {}  # tool call id -> its index in the reply

    def opening(self) -> list[str]:
        return [sse(self._base([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))]

    def delta(self, kind: str, value) -> list[str]:
        if kind == "tool_call":  # a call begins: its id and name
            index = self.calls.setdefault(value["id"], len(self.calls))
            [call] = reply_calls([{**value, "arguments": ""}])
            delta = {"tool_calls": [{"index": index, **call}]}
        elif kind == "tool_arguments":  # a piece of its arguments
            delta = {"tool_calls": [{"index": self.calls[value["id"]], "function": {"arguments": value["text"]}}]}
        else:
            delta = {"reasoning_content": value} if kind == "reasoning" else {"content": value}
        return [sse(self._base([{"index": 0, "delta": delta, "finish_reason": None}]))]

    @staticmethod
    def finish(reply: Reply) -> Optional[str]:
        """OpenAI's finish_reason: a reply that ends in tool calls ends for them."""
        calls = reply.result.tool_calls
        return "tool_calls" if calls and reply.finish_reason == "stop" else reply.finish_reason

    def whole(self, reply: Reply) -> dict:
        calls = reply.result.tool_calls
        message = {"role": "assistant", "content": reply.text or (None if calls else "")}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if calls:
            message["tool_calls"] = reply_calls(calls)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": self.finish(reply),
                             **self.logprobs(reply.result)}],
                "usage": self.usage(reply.result), "mlx_stream": self.extension(reply.result)}


class TextShape(Shape):
    prefix, chunk_object = "cmpl", "text_completion"
    last_choice = {"text": ""}

    @staticmethod
    def logprobs(result: Result) -> dict:
        return _text_logprobs(result)

    def opening(self) -> list[str]:
        return [sse(self._base([{"index": 0, "text": "", "finish_reason": None}]))]

    def delta(self, kind: str, value: str) -> list[str]:
        return [sse(self._base([{"index": 0, "text": value if kind == "text" else "", "finish_reason": None}]))]

    def whole(self, reply: Reply) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": reply.text, "finish_reason": reply.finish_reason,
                             **self.logprobs(reply.result)}],
                "usage": self.usage(reply.result), "mlx_stream": self.extension(reply.result)}


def _chat_logprobs(result: Result) -> dict:
    """A chat choice's `logprobs`, when they were asked for."""
    entries = result.stats.get("logprobs")
    if entries is None:
        return {}
    return {"logprobs": {"content": [{**_with_bytes(e), "top_logprobs": [_with_bytes(t) for t in e["top_logprobs"]]}
                                     for e in entries]}}


def _with_bytes(entry: dict) -> dict:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": list(entry["token"].encode())}


def _text_logprobs(result: Result) -> dict:
    """A completion choice's `logprobs` (the legacy layout), when they were asked for."""
    entries = result.stats.get("logprobs")
    if entries is None:
        return {}
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"logprobs": {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                         "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                         "text_offset": offsets}}
