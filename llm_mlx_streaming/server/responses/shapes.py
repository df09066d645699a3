"""The Responses API's layouts of a reply: one `response` object, or its event stream
(response.created, .in_progress, an output item per reasoning, message and call with
their part and delta events, .completed; .failed with the error).

Reasoning comes as a `reasoning` item whose summary is the reasoning text, the text as a
`message` item, each tool call as a `function_call` item (`custom_tool_call` for a custom
tool), all carrying the `mlx_stream` extension's figures and ids on the response.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from ...reply.events import CallArguments, CallBegins, Event, Outcome, ToolCall
from ..shape import KEEPALIVE, sse_event
from ..transcript import Transcript, extension


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseShape:
    media_type = "text/event-stream"

    def __init__(self, model_id: str, echo: dict, *, custom: frozenset = frozenset(),
                 namespaces: Optional[dict] = None, forced_custom: Optional[str] = None) -> None:
        """`echo`: the request's fields the response repeats; `custom`: the names of custom
        tools (their calls' arguments are {"input": text}); `namespaces`: function name ->
        the namespace tool it came in; `forced_custom`: the custom tool the whole reply is
        the input of. Once the reply is laid out whole, `finished` is its response (the
        route stores it)."""
        self.model, self.echo = model_id, echo
        self.custom, self.namespaces, self.forced_custom = custom, namespaces or {}, forced_custom
        self.finished: Optional[dict] = None
        self.id = new_id("resp")
        self.created = int(time.time())  # whole seconds, as OpenAI sends them
        self.sequence = 0
        self.items: list[dict] = []  # the output items streamed so far
        self._open: Optional[str] = None  # "reasoning" | "text" | "custom" | a call's id
        self._arguments = ""  # a custom tool call's arguments as they come ({"input": ...})

    # -- the body -----------------------------------------------------------------
    def _response(self, status: str, output: list, outcome: Optional[Outcome] = None,
                  error: Optional[dict] = None) -> dict:
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": error, "incomplete_details": None,
                "usage": usage(outcome) if outcome is not None else None, **self.echo}
        if outcome is not None:
            if outcome.finish_reason == "length":
                body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            body["completed_at"] = int(time.time())
            body["mlx_stream"] = extension(outcome)
        return body

    def whole(self, transcript: Transcript) -> dict:
        output = []
        if transcript.reasoning:
            output.append(self._reasoning_item(new_id("rs"), transcript.reasoning))
        if self.forced_custom is not None:
            output.append(self._custom_call(new_id("ctc"), ToolCall(new_id("call"), self.forced_custom,
                                                                    {"input": transcript.text})))
        elif transcript.text or not transcript.outcome.tool_calls:  # as streamed: a reply of calls has no message
            output.append(self._message_item(new_id("msg"), transcript.text))
        output.extend(self._call_item(call) for call in transcript.outcome.complete_calls())
        if output and _cut(transcript.outcome) and not _cut_call(transcript.outcome):
            output[-1]["status"] = "incomplete"  # the item the token limit ended, as the response says
        return self._finished(transcript, output)

    def _finished(self, transcript: Transcript, output: list) -> dict:
        self.finished = self._response("completed", output, transcript.outcome)
        return self.finished

    # -- the stream -----------------------------------------------------------------
    def _event(self, kind: str, data: dict) -> str:
        self.sequence += 1
        return sse_event(kind, {"sequence_number": self.sequence - 1, **data})

    def opening(self) -> list[str]:
        start = self._response("in_progress", [])
        return [self._event("response.created", {"response": start}),
                self._event("response.in_progress", {"response": start})]

    @staticmethod
    def keepalive() -> str:
        return KEEPALIVE

    def delta(self, ev: Event) -> list[str]:
        if isinstance(ev, CallBegins):
            frames = self._close()
            self._open = ev.id
            if ev.name in self.custom:
                item = self._custom_call(new_id("ctc"), ToolCall(ev.id, ev.name, {"input": ""}), status="in_progress")
            else:
                item = {**self._call_item(ToolCall(ev.id, ev.name, {})), "arguments": "", "status": "in_progress"}
            return frames + self._added(item)
        if isinstance(ev, CallArguments):
            item = self.items[-1]
            if item["type"] != "function_call":  # a custom tool's input comes whole, at its end
                self._arguments += ev.text
                return []
            item["arguments"] += ev.text
            return [self._event("response.function_call_arguments.delta",
                                {"item_id": item["id"], "output_index": len(self.items) - 1, "delta": ev.text})]
        kind = "custom" if ev.kind == "text" and self.forced_custom is not None else ev.kind
        frames = [] if self._open == kind else self._close() + self._begin(kind)
        self._open = kind
        item, index = self.items[-1], len(self.items) - 1
        if kind == "reasoning":
            item["summary"][0]["text"] += ev.text
            return frames + [self._event("response.reasoning_summary_text.delta", {
                "item_id": item["id"], "output_index": index, "summary_index": 0, "delta": ev.text})]
        if kind == "custom":
            item["input"] += ev.text
            return frames + [self._event("response.custom_tool_call_input.delta", {
                "item_id": item["id"], "output_index": index, "delta": ev.text})]
        item["content"][0]["text"] += ev.text
        return frames + [self._event("response.output_text.delta", {
            "item_id": item["id"], "output_index": index, "content_index": 0, "delta": ev.text, "logprobs": []})]

    def _added(self, item: dict) -> list[str]:
        self.items.append(item)
        return [self._event("response.output_item.added", {"output_index": len(self.items) - 1, "item": item})]

    def _begin(self, kind: str) -> list[str]:
        if kind == "reasoning":
            frames = self._added({**self._reasoning_item(new_id("rs"), ""), "status": "in_progress"})
            part = {"type": "summary_text", "text": ""}
            return frames + [self._event("response.reasoning_summary_part.added", {
                "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "summary_index": 0,
                "part": part})]
        if kind == "custom":
            call = ToolCall(new_id("call"), self.forced_custom, {"input": ""})
            return self._added(self._custom_call(new_id("ctc"), call, status="in_progress"))
        frames = self._added({**self._message_item(new_id("msg"), ""), "status": "in_progress"})
        return frames + [self._event("response.content_part.added", {
            "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []}})]

    def _close(self, status: str = "completed") -> list[str]:
        """The done events of the item being streamed."""
        if self._open is None:
            return []
        item, index = self.items[-1], len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        frames = []
        if item["type"] == "reasoning":
            text = item["summary"][0]["text"]
            frames += [self._event("response.reasoning_summary_text.done", {**where, "summary_index": 0, "text": text}),
                       self._event("response.reasoning_summary_part.done", {
                           **where, "summary_index": 0, "part": {"type": "summary_text", "text": text}})]
        elif item["type"] == "message":
            part = item["content"][0]
            frames += [self._event("response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                                                 "logprobs": []}),
                       self._event("response.content_part.done", {**where, "content_index": 0, "part": part})]
        elif item["type"] == "function_call":
            frames.append(self._event("response.function_call_arguments.done", {
                **where, "arguments": item["arguments"], "name": item["name"]}))
        elif item["type"] == "custom_tool_call":
            if self._open != "custom":  # a call in the model's markup: its input is the argument
                item["input"] = _input(self._arguments)
                self._arguments = ""
            frames.append(self._event("response.custom_tool_call_input.done", {**where, "input": item["input"]}))
        item["status"] = status
        frames.append(self._event("response.output_item.done", {"output_index": index, "item": item}))
        self._open = None
        return frames

    def closing(self, transcript: Transcript) -> list[str]:
        """The last item's done events (`incomplete` when the token limit ended it), then the
        response, less a tool call the limit cut off (its arguments are no whole JSON)."""
        cut = _cut_call(transcript.outcome)
        frames = self._close("incomplete" if _cut(transcript.outcome) else "completed")
        if not self.items:  # an empty reply is an empty message
            frames += self._begin("text")
            self._open = "text"
            frames += self._close("incomplete" if _cut(transcript.outcome) else "completed")
        body = self._finished(transcript, [item for item in self.items if item.get("call_id") not in cut])
        return frames + [self._event("response.completed", {"response": body})]

    def failure(self, error) -> list[str]:
        failed = self._response("failed", self.items, error={"code": "server_error" if error.status >= 500
                                                             else "invalid_prompt", "message": error.message})
        return [self._event("response.failed", {"response": failed})]

    # -- the items ----------------------------------------------------------------
    @staticmethod
    def _reasoning_item(item_id: str, text: str) -> dict:
        return {"type": "reasoning", "id": item_id, "summary": [{"type": "summary_text", "text": text}],
                "status": "completed"}

    @staticmethod
    def _message_item(item_id: str, text: str) -> dict:
        return {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def _call_item(self, call: ToolCall) -> dict:
        if call.name in self.custom:
            return self._custom_call(new_id("ctc"), call)
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments_text, "status": "completed"}
        if call.name in self.namespaces:
            item["namespace"] = self.namespaces[call.name]
        return item

    def _custom_call(self, item_id: str, call: ToolCall, status: str = "completed") -> dict:
        item = {"type": "custom_tool_call", "id": item_id, "call_id": call.id, "name": call.name,
                "input": str(call.arguments.get("input", "")), "status": status}
        if call.name in self.namespaces:
            item["namespace"] = self.namespaces[call.name]
        return item


def _cut(outcome: Outcome) -> bool:
    """Whether the token limit ended the reply (the response is `incomplete`)."""
    return outcome.finish_reason == "length"


def _cut_call(outcome: Outcome) -> set[str]:
    """The ids of the tool calls the token limit cut off."""
    return {call.id for call in outcome.tool_calls if not call.complete}


def usage(outcome: Outcome) -> dict:
    return {"input_tokens": outcome.prompt_tokens, "input_tokens_details": {"cached_tokens": outcome.cached_tokens,
                                                                             "cache_write_tokens": 0},
            "output_tokens": outcome.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


def _input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote for it."""
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    return str(parsed.get("input", "")) if isinstance(parsed, dict) else arguments
