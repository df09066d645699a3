"""The Anthropic Messages layouts of a reply: one `message` body, or its event stream
(message_start, content_block_start/delta/stop per block, message_delta with the stop
reason and usage, message_stop).

Reasoning comes as `thinking` blocks, the text as a `text` block. Usage counts the
prompt tokens the KV cache held as `cache_read_input_tokens` and the rest as
`input_tokens`; the `mlx_stream` extension carries the engine's figures and token ids.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from .bridge import Reply, Result

BLOCK_OF = {"reasoning": ("thinking", "thinking_delta", "thinking"), "text": ("text", "text_delta", "text")}


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def stop_reason(result: Result) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished run."""
    stop = result.stats.get("stop_sequence")
    if result.complete_calls() and result.finish_reason == "stop":
        return "tool_use", None
    if stop is not None:
        return "stop_sequence", stop
    return ("max_tokens" if result.finish_reason == "length" else "end_turn"), None


def usage(result: Result) -> dict:
    reused = int(result.stats.get("reused_tokens") or 0)
    return {"input_tokens": result.prompt_tokens - reused, "output_tokens": result.completion_tokens,
            "cache_read_input_tokens": reused, "cache_creation_input_tokens": 0}


def tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["name"], "input": call["input"]}


def extension(result: Result) -> dict:
    return {"stats": result.stats, "tokens": result.tokens, "resolved_model": result.resolved_model}


class MessageShape:
    media_type = "text/event-stream"

    def __init__(self, model_id: str) -> None:
        self.model = model_id
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._index = -1
        self._open: Optional[str] = None  # the kind of the block being streamed

    def _message(self, content: list, reason: Optional[str], stop: Optional[str], use: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop, "usage": use}

    def whole(self, reply: Reply) -> dict:
        content = []
        if reply.reasoning:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        calls = reply.result.complete_calls()
        if reply.text or not calls:
            content.append({"type": "text", "text": reply.text})
        content.extend(tool_use(call) for call in calls)
        reason, stop = stop_reason(reply.result)
        return {**self._message(content, reason, stop, usage(reply.result)), "mlx_stream": extension(reply.result)}

    # -- the stream ---------------------------------------------------------------
    def opening(self) -> list[str]:
        start = self._message([], None, None, {"input_tokens": 0, "output_tokens": 0})
        return [event("message_start", {"message": start})]

    def delta(self, kind: str, value) -> list[str]:
        if kind == "tool_call":  # a block of its own; its input follows in pieces
            return self._start(kind, {"type": "tool_use", "id": value["id"], "name": value["name"], "input": {}})
        if kind == "tool_arguments":
            return [self._delta({"type": "input_json_delta", "partial_json": value["text"]})]
        block, delta_type, key = BLOCK_OF[kind]
        frames = [] if kind == self._open else self._start(kind, {"type": block, key: "", **self._signature(kind)})
        return frames + [self._delta({"type": delta_type, key: value})]

    def _start(self, kind: str, block: dict) -> list[str]:
        frames = self._close_block()
        self._index += 1
        self._open = kind
        return frames + [event("content_block_start", {"index": self._index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self._index, "delta": delta})

    def _close_block(self) -> list[str]:
        if self._open is None:
            return []
        frames = []
        if self._open == "reasoning":
            frames.append(self._delta({"type": "signature_delta", "signature": ""}))
        frames.append(event("content_block_stop", {"index": self._index}))
        self._open = None
        return frames

    @staticmethod
    def _signature(kind: str) -> dict:
        return {"signature": ""} if kind == "reasoning" else {}

    def closing(self, reply: Reply) -> list[str]:
        text_block = self._open == "text" or self._index >= 0 and reply.result.tool_calls
        frames = [] if text_block else self.delta("text", "")  # a text block, unless it is all calls
        frames += self._close_block()
        reason, stop = stop_reason(reply.result)
        frames.append(event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                              "usage": usage(reply.result), "mlx_stream": extension(reply.result)}))
        return frames + [event("message_stop", {})]

    def failure(self, error) -> list[str]:
        return [event("error", {"error": error.response_body("/v1/messages")["error"]})]
