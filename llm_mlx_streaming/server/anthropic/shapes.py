"""The Anthropic Messages layouts of a reply: one `message` body, or its event stream
(message_start, content_block_start/delta/stop per block, message_delta with the stop
reason and usage, message_stop).

Reasoning comes as `thinking` blocks, the text as a `text` block. Usage counts the
prompt tokens the KV cache held as `cache_read_input_tokens` and the rest as
`input_tokens`; the `mlx_stream` extension carries the engine's figures and token ids.
"""

from __future__ import annotations

import uuid
from typing import Optional

from ...reply.events import CallArguments, CallBegins, Event, Outcome, ToolCall
from ..shape import sse_event
from ..transcript import Transcript, extension

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
               503: "overloaded_error"}
BLOCK_OF = {"reasoning": ("thinking", "thinking_delta", "thinking"), "text": ("text", "text_delta", "text")}


def error_body(error) -> dict:
    """An errors.ApiError as Anthropic's error object."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def stop_reason(outcome: Outcome) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if outcome.ended_for_calls:
        return "tool_use", None
    if outcome.stop_sequence is not None:
        return "stop_sequence", outcome.stop_sequence
    return ("max_tokens" if outcome.finish_reason == "length" else "end_turn"), None


def usage(outcome: Outcome) -> dict:
    cached = outcome.cached_tokens
    return {"input_tokens": outcome.prompt_tokens - cached, "output_tokens": outcome.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


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

    def whole(self, transcript: Transcript) -> dict:
        outcome = transcript.outcome
        content = []
        if transcript.reasoning:
            content.append({"type": "thinking", "thinking": transcript.reasoning, "signature": ""})
        calls = outcome.complete_calls()
        if transcript.text or not calls:
            content.append({"type": "text", "text": transcript.text})
        content.extend(tool_use(call) for call in calls)
        reason, stop = stop_reason(outcome)
        return {**self._message(content, reason, stop, usage(outcome)), "mlx_stream": extension(outcome)}

    # -- the stream ---------------------------------------------------------------
    @staticmethod
    def keepalive() -> str:
        return sse_event("ping", {})

    def opening(self) -> list[str]:
        start = self._message([], None, None, {"input_tokens": 0, "output_tokens": 0})
        return [sse_event("message_start", {"message": start})]

    def delta(self, event: Event) -> list[str]:
        if isinstance(event, CallBegins):  # a block of its own; its input follows in pieces
            return self._start("tool_call", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, CallArguments):
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        return self._chunk(event.kind, event.text)

    def _chunk(self, kind: str, text: str) -> list[str]:
        block, delta_type, key = BLOCK_OF[kind]
        frames = [] if kind == self._open else self._start(kind, {"type": block, key: "", **self._signature(kind)})
        return frames + [self._delta({"type": delta_type, key: text})]

    def _start(self, kind: str, block: dict) -> list[str]:
        frames = self._close_block()
        self._index += 1
        self._open = kind
        return frames + [sse_event("content_block_start", {"index": self._index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"index": self._index, "delta": delta})

    def _close_block(self) -> list[str]:
        if self._open is None:
            return []
        frames = []
        if self._open == "reasoning":
            frames.append(self._delta({"type": "signature_delta", "signature": ""}))
        frames.append(sse_event("content_block_stop", {"index": self._index}))
        self._open = None
        return frames

    @staticmethod
    def _signature(kind: str) -> dict:
        return {"signature": ""} if kind == "reasoning" else {}

    def closing(self, transcript: Transcript) -> list[str]:
        outcome = transcript.outcome
        text_block = self._open == "text" or self._index >= 0 and outcome.tool_calls
        frames = [] if text_block else self._chunk("text", "")  # a text block, unless it is all calls
        frames += self._close_block()
        reason, stop = stop_reason(outcome)
        frames.append(sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                              "usage": usage(outcome), "mlx_stream": extension(outcome)}))
        return frames + [sse_event("message_stop", {})]

    def failure(self, error) -> list[str]:
        return [sse_event("error", {"error": error_body(error)["error"]})]
