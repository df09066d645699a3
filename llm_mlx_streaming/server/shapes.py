"""The OpenAI layouts of a reply: chat or text, streamed chunks or one body.

Both carry the `mlx_stream` extension (the engine's figures, the reply's token ids, the
checkpoint) so `llm` can log exactly what an in-process run logs.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from .bridge import Result
from .openai_tools import reply_calls


class Shape:
    """How one route's chunks and bodies look."""

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

    def usage_chunk(self, result: Result) -> dict:
        return {**self._base([]), "usage": self.usage(result)}


class ChatShape(Shape):
    prefix, chunk_object = "chatcmpl", "chat.completion.chunk"

    def __init__(self, model_id: str, body) -> None:
        super().__init__(model_id, body)
        self.calls: dict[str, int] = {}  # tool call id -> its index in the reply

    def opening(self) -> dict:
        return self._base([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def delta(self, text: str = "", reasoning: str = "", tool_call: Optional[dict] = None,
              tool_arguments: Optional[dict] = None) -> dict:
        if tool_call is not None:  # a call begins: its id and name
            index = self.calls.setdefault(tool_call["id"], len(self.calls))
            [call] = reply_calls([{**tool_call, "arguments": ""}])
            delta = {"tool_calls": [{"index": index, **call}]}
        elif tool_arguments is not None:  # a piece of its arguments
            delta = {"tool_calls": [{"index": self.calls[tool_arguments["id"]],
                                     "function": {"arguments": tool_arguments["text"]}}]}
        else:
            delta = {"reasoning_content": reasoning} if reasoning else {"content": text}
        return self._base([{"index": 0, "delta": delta, "finish_reason": None}])

    def closing(self, finish: Optional[str], result: Result) -> dict:
        choice = {"index": 0, "delta": {}, "finish_reason": _finish(finish, result)}
        return {**self._base([{**choice, **_chat_logprobs(result)}]), "mlx_stream": self.extension(result)}

    def whole(self, text: str, reasoning: str, finish, result: Result) -> dict:
        message = {"role": "assistant", "content": text or (None if result.tool_calls else "")}
        if reasoning:
            message["reasoning_content"] = reasoning
        if result.tool_calls:
            message["tool_calls"] = reply_calls(result.tool_calls)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": _finish(finish, result),
                             **_chat_logprobs(result)}],
                "usage": self.usage(result), "mlx_stream": self.extension(result)}


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


def _finish(finish: Optional[str], result: Result) -> Optional[str]:
    """OpenAI's finish_reason: a reply that ends in tool calls ends for them."""
    return "tool_calls" if result.tool_calls and finish == "stop" else finish


class TextShape(Shape):
    prefix, chunk_object = "cmpl", "text_completion"

    def opening(self) -> dict:
        return self._base([{"index": 0, "text": "", "finish_reason": None}])

    def delta(self, text: str = "", reasoning: str = "") -> dict:
        return self._base([{"index": 0, "text": text, "finish_reason": None}])

    def closing(self, finish: Optional[str], result: Result) -> dict:
        return {**self._base([{"index": 0, "text": "", "finish_reason": finish, **_text_logprobs(result)}]),
                "mlx_stream": self.extension(result)}

    def whole(self, text: str, reasoning: str, finish, result: Result) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, **_text_logprobs(result)}],
                "usage": self.usage(result), "mlx_stream": self.extension(result)}
