"""The recorder's scripted replies: minimal, well-formed answers in each API's shape (a
tool call where the prompt carries CUE, text that ends the turn after its result)."""

from __future__ import annotations

import json
import re

MODEL = "mlx-stream/tiny"
CLAUDE_MODEL = "claude-sonnet-4-5"  # what Claude Code sends when left to its own names
CUE = "(use a tool)"
PROMPT_TOOL = f"List the files in the current directory {CUE}, then say done."
PROMPT_LATER = "Thanks. Now say goodbye in one word."
PROMPT_WEATHER = f"What is the weather in Paris? {CUE}"
PROMPT_SESSION2 = f"Print today's date {CUE}, then say done."  # its 5th, 8th, 21st characters differ from PROMPT_TOOL's
FINAL_TEXT = "Done: the listing came back."
PLAIN_TEXT = "Hello from the recorder."


# -- scripted replies ------------------------------------------------------------


def _texts(content) -> list[str]:
    """Every text in a message's content (a string or a list of blocks/parts)."""
    if isinstance(content, str):
        return [content]
    out = []
    for block in content or []:
        if isinstance(block, dict):
            for key in ("text", "content"):
                if isinstance(block.get(key), str):
                    out.append(block[key])
    return out


def content_blocks(content) -> list[dict]:
    if isinstance(content, list):
        return [b for b in content if isinstance(b, dict)]
    return [{"type": "text", "text": content or ""}]


def trailing_messages(messages: list[dict], stop_role: str) -> list[dict]:
    """The messages after the last one whose role is `stop_role`."""
    out = []
    for m in reversed(messages):
        if not isinstance(m, dict) or m.get("role") == stop_role:
            break
        out.append(m)
    return out[::-1]


def _sample(name: str, schema: dict):
    """A plausible value for a tool argument, from its name and JSON schema."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if name in ("command", "cmd"):
        return ["ls"] if kind == "array" else "ls"
    if name == "description":
        return "List the files in the current directory"
    if name in ("city", "location"):
        return "Paris"
    if "enum" in schema:
        return schema["enum"][0]
    return {"string": "x", "integer": 1, "number": 1, "boolean": False, "array": [],
            "object": {}}.get(kind, "x")


def _arguments(parameters: dict) -> dict:
    props = (parameters or {}).get("properties") or {}
    required = (parameters or {}).get("required") or []
    return {k: _sample(k, props[k]) for k in props if k in required or k in ("command", "cmd")}


# Tool names to prefer for the scripted call, in order; else the first function tool.
PREFERRED_TOOLS = ("Bash", "exec_command", "shell_command", "shell", "get_weather")


def _pick_tool(tools: list[dict]) -> tuple[str, dict, str | None] | None:
    """(name, parameters schema, namespace) of the tool to call, from a request's tools
    in either API's shape (namespace tools are looked into)."""
    found = {}
    for tool in tools or []:
        if tool.get("type") == "namespace":
            for inner in tool.get("tools") or []:
                if inner.get("name"):
                    found.setdefault(inner["name"], (inner.get("parameters") or {}, tool.get("name")))
            continue
        if tool.get("type") == "function" and isinstance(tool.get("function"), dict):  # chat
            fn = tool["function"]
            found.setdefault(fn["name"], (fn.get("parameters") or {}, None))
        elif tool.get("name") and tool.get("type") in (None, "function", "custom"):
            schema = tool.get("input_schema") or tool.get("parameters") or {}
            found.setdefault(tool["name"], (schema, None))
    for name in PREFERRED_TOOLS:
        if name in found:
            return name, *found[name]
    for name, (schema, ns) in found.items():
        return name, schema, ns
    return None


def usage_estimate(body_bytes: int) -> int:
    return max(1, body_bytes // 4)


class Replies:
    """Builds each API's scripted reply; ids are numbered per label, so they repeat."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def next_id(self, label: str, kind: str) -> str:
        key = f"{label}/{kind}"
        self.counts[key] = self.counts.get(key, 0) + 1
        return f"{kind}_rec_{re.sub(r'[^a-z0-9]', '', label.lower())}_{self.counts[key]:02d}"

    # Anthropic Messages ---------------------------------------------------------

    def anthropic(self, body: dict, label: str, size: int):
        # This turn's new input: the messages after the last assistant message (Claude
        # Code puts a `system` message after the user's).
        blocks = [b for m in trailing_messages(body.get("messages") or [], "assistant")
                  for b in content_blocks(m.get("content"))]
        model = body.get("model") or MODEL
        content, stop = [], "end_turn"
        if any(b.get("type") == "tool_result" for b in blocks):
            content = [{"type": "text", "text": FINAL_TEXT}]
        else:
            tool = _pick_tool(body.get("tools") or [])
            if tool and any(CUE in t for t in _texts(blocks)):
                name, schema, _ = tool
                content = [
                    {"type": "text", "text": "Let me call a tool."},
                    {"type": "tool_use", "id": self.next_id(label, "toolu"), "name": name,
                     "input": _arguments(schema)},
                ]
                stop = "tool_use"
            else:
                content = [{"type": "text", "text": PLAIN_TEXT}]
        usage = {"input_tokens": usage_estimate(size), "output_tokens": 12,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        message = {"id": self.next_id(label, "msg"), "type": "message", "role": "assistant",
                   "model": model, "content": content, "stop_reason": stop,
                   "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            return 200, message, None
        events = [("message_start", {"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}})]
        for i, block in enumerate(content):
            if block["type"] == "text":
                events.append(("content_block_start", {"type": "content_block_start", "index": i,
                                                       "content_block": {"type": "text", "text": ""}}))
                if i == 0:
                    events.append(("ping", {"type": "ping"}))
                events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                               "delta": {"type": "text_delta", "text": block["text"]}}))
            else:
                events.append(("content_block_start", {"type": "content_block_start", "index": i,
                               "content_block": {**block, "input": {}}}))
                events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": json.dumps(block["input"])}}))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop, "stop_sequence": None},
                                         "usage": {"output_tokens": 12}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return 200, None, events

    # OpenAI Responses -------------------------------------------------------------

    def responses(self, body: dict, label: str, size: int):
        items = body.get("input")
        items = [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else (items or [])
        # The trailing run of user/developer messages: this turn's new input.
        trailing = []
        for item in reversed(items):
            if item.get("type", "message") == "message" and item.get("role") in ("user", "developer", "system"):
                trailing.append(item)
            else:
                break
        rid = self.next_id(label, "resp")
        output = []
        if items and items[-1].get("type") in ("function_call_output", "custom_tool_call_output"):
            output = [self._message(label, FINAL_TEXT)]
        else:
            tool = _pick_tool(body.get("tools") or [])
            if tool and any(CUE in t for item in trailing for t in _texts(item.get("content"))):
                name, schema, namespace = tool
                call = {"type": "function_call", "id": self.next_id(label, "fc"),
                        "call_id": self.next_id(label, "call"), "name": name,
                        "arguments": json.dumps(_arguments(schema)), "status": "completed"}
                if namespace:
                    call["namespace"] = namespace
                output = [call]
            else:
                output = [self._message(label, PLAIN_TEXT)]
        usage = {"input_tokens": usage_estimate(size), "output_tokens": 12, "total_tokens": 0,
                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        response = {
            "id": rid, "object": "response", "created_at": 1700000000, "status": "completed",
            "model": body.get("model") or MODEL, "output": output, "error": None,
            "incomplete_details": None, "instructions": None, "metadata": {},
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
            "text": {"format": {"type": "text"}}, "usage": usage,
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True),
        }
        if not body.get("stream"):
            return 200, response, None
        seq = iter(range(10_000))
        events = []

        def emit(kind, **fields):
            events.append((kind, {"type": kind, "sequence_number": next(seq), **fields}))

        pending = {**response, "status": "in_progress", "output": [], "usage": None}
        emit("response.created", response=pending)
        emit("response.in_progress", response=pending)
        for index, item in enumerate(output):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                emit("response.content_part.added", item_id=item["id"], output_index=index,
                     content_index=0, part=part)
                emit("response.output_text.delta", item_id=item["id"], output_index=index,
                     content_index=0, delta=text, logprobs=[])
                emit("response.output_text.done", item_id=item["id"], output_index=index,
                     content_index=0, text=text, logprobs=[])
                emit("response.content_part.done", item_id=item["id"], output_index=index,
                     content_index=0, part={**part, "text": text})
            else:
                emit("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "arguments": ""})
                emit("response.function_call_arguments.delta", item_id=item["id"],
                     output_index=index, delta=item["arguments"])
                emit("response.function_call_arguments.done", item_id=item["id"],
                     output_index=index, arguments=item["arguments"], name=item["name"])
            emit("response.output_item.done", output_index=index, item=item)
        emit("response.completed", response=response)
        return 200, None, events

    def _message(self, label: str, text: str) -> dict:
        return {"type": "message", "id": self.next_id(label, "msg"), "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    # OpenAI chat completions ---------------------------------------------------------

    def chat(self, body: dict, label: str, size: int):
        messages = body.get("messages") or [{}]
        last = messages[-1]
        message = {"role": "assistant", "content": PLAIN_TEXT}
        finish = "stop"
        if last.get("role") == "tool":
            message["content"] = FINAL_TEXT
        else:
            tool = _pick_tool(body.get("tools") or [])
            if tool and last.get("role") == "user" and any(CUE in t for t in _texts(last.get("content"))):
                name, schema, _ = tool
                message = {"role": "assistant", "content": None, "tool_calls": [{
                    "id": self.next_id(label, "call"), "type": "function",
                    "function": {"name": name, "arguments": json.dumps(_arguments(schema))}}]}
                finish = "tool_calls"
        usage = {"prompt_tokens": usage_estimate(size), "completion_tokens": 12,
                 "total_tokens": usage_estimate(size) + 12}
        cid = self.next_id(label, "chatcmpl")
        model = body.get("model") or MODEL
        if not body.get("stream"):
            return 200, {"id": cid, "object": "chat.completion", "created": 1700000000,
                         "model": model, "choices": [{"index": 0, "message": message,
                                                      "finish_reason": finish, "logprobs": None}],
                         "usage": usage}, None
        base = {"id": cid, "object": "chat.completion.chunk", "created": 1700000000, "model": model}
        delta = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta = {"role": "assistant", "content": None,
                     "tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
        events = [(None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}),
                  (None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append((None, {**base, "choices": [], "usage": usage}))
        events.append((None, "[DONE]"))
        return 200, None, events


def models_list() -> dict:
    """One model, in the OpenAI and the Anthropic list shape at once."""
    model = {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "recorder",
             "type": "model", "display_name": MODEL, "created_at": "2025-01-01T00:00:00Z"}
    return {"object": "list", "data": [model], "has_more": False, "first_id": MODEL, "last_id": MODEL}
