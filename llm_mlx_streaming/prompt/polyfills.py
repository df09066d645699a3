"""A real client's conversation through a real model's chat template: what the template
reads but the client did not send (or sent in another shape) is filled in, as the
model's publishers' reference code and llama.cpp's template polyfills do, and only where
the template needs it, so a template that renders the request as it is sees it as it is.

- tool results folded into the calling turn as `tool_responses` (Gemma 4's template
  reads them there; as a `tool` turn it writes a role the model never saw);
- call ids as the model writes them, where it names its calls itself (Kimi-K2's
  `functions.NAME:i`, which its template writes back), the results' ids with them;
- earlier calls written into the turn's text in the model's own markup, where the
  template never renders `tool_calls` (Kimi-K2 Instruct's, as llama.cpp ships it);
- the tools described in the system prompt as the model's publishers describe them,
  where the template never renders `tools` (DeepSeek-V3.1's: its model card has the
  caller write them there);
then, only when rendering fails, in turn: a `type` for schema properties that have
none (Gemma 4 reads `value['type']`; Claude Code's tools leave it out), the calls'
arguments as JSON text (DeepSeek-V3.1's template concatenates them), call ids of nine
letters and digits (Mistral's template refuses any other), and a system message after
the first turn (Claude Code sends one) as part of the user's turn (Mistral's template
takes a system message only first).
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from typing import Callable, Optional

from ..formats.registry import format_of
from .messages import PromptError

Render = Callable[[list[dict], Optional[list[dict]]], str]


def fitted(tokenizer, messages: list[dict], tools: Optional[list[dict]],
           render: Render) -> tuple[list[dict], Optional[list[dict]], str]:
    """(messages, tools) as this template renders them, and what it renders; a
    PromptError in one line when it cannot render them at all."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    if "tool_responses" in template:
        messages = fold_tool_responses(messages)
    messages = model_call_ids(tokenizer, messages)
    if "tool_calls" not in template:
        messages = inline_calls(tokenizer, messages)
    if tools and not re.search(r"\btools\b", template):
        messages = declared_tools(tokenizer, messages, tools)
    try:
        return messages, tools, render(messages, tools)
    except Exception as exc:  # the template's own error: try what it may be missing
        failure = exc
    for fix in (typed_tools, string_arguments, short_call_ids, later_system_as_user):
        fixed = fix(messages, tools)
        if fixed == (messages, tools):
            continue
        messages, tools = fixed
        try:
            return messages, tools, render(messages, tools)
        except Exception as exc:
            failure = exc
    raise PromptError(f"the model's chat template cannot render this conversation: "
                      f"{type(failure).__name__}: {_line(failure)}") from None


def _line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text[:300]


def fold_tool_responses(messages: list[dict]) -> list[dict]:
    """`tool` messages after a turn that made calls, as that turn's `tool_responses`
    ({"name", "response"}: the result as JSON where it is JSON, else its text)."""
    out: list[dict] = []
    for message in messages:
        if message["role"] == "tool" and out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
            names = {c.get("id"): c["function"]["name"] for c in out[-1]["tool_calls"]}
            response = {"name": message.get("name") or names.get(message.get("tool_call_id"), "unknown"),
                        "response": _json_or_text(message.get("content"))}
            out[-1] = {**out[-1], "tool_responses": [*out[-1].get("tool_responses", []), response]}
        else:
            out.append(message)
    return out


def _json_or_text(content):
    if isinstance(content, str):
        try:
            value = json.loads(content)
        except ValueError:
            return content
        return value if isinstance(value, dict) else content
    return content


def inline_calls(tokenizer, messages: list[dict]) -> list[dict]:
    """Earlier calls written after the turn's text in the format's markup, for a
    template that renders only text."""
    fmt = format_of(tokenizer)
    if fmt is None or fmt.write is None or not any(m.get("tool_calls") for m in messages):
        return messages
    out = []
    for message in messages:
        if calls := message.get("tool_calls"):
            written = fmt.write([(c.get("id"), c["function"]["name"], _as_dict(c["function"]["arguments"]))
                                 for c in calls])
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = (message.get("content") or "") + written
        out.append(message)
    return out


def model_call_ids(tokenizer, messages: list[dict]) -> list[dict]:
    """Each call's id as the model would have written it (numbered through the
    conversation), and its result's id with it, for a format that names its calls."""
    fmt = format_of(tokenizer)
    if fmt is None or fmt.call_id is None or not any(m.get("tool_calls") for m in messages):
        return messages
    ids: dict = {}
    out = []
    for message in messages:
        if calls := message.get("tool_calls"):
            renamed = []
            for call in calls:
                ids[call.get("id")] = fmt.call_id(call["function"]["name"], len(ids))
                renamed.append({**call, "id": ids[call.get("id")]})
            message = {**message, "tool_calls": renamed}
        if message.get("tool_call_id") in ids:
            message = {**message, "tool_call_id": ids[message["tool_call_id"]]}
        out.append(message)
    return out


def declared_tools(tokenizer, messages: list[dict], tools: list[dict]) -> list[dict]:
    """The format's description of the tools after the first system message's text (a
    system message of its own where there is none), for a template that renders no
    `tools`; the same place every turn, so the prompt's start stays the same."""
    fmt = format_of(tokenizer)
    if fmt is None or fmt.declare is None:
        return messages
    declaration = fmt.declare(tools)
    if messages and messages[0]["role"] == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{declaration}"}, *messages[1:]]
    return [{"role": "system", "content": declaration}, *messages]


def _as_dict(arguments):
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def typed_tools(messages, tools):
    """Every property of every tool's parameters given a `type` (the one its schema
    implies; "string" where nothing does)."""
    if not tools:
        return messages, tools
    return messages, [_typed_tool(t) for t in tools]


def _typed_tool(tool: dict) -> dict:
    function = tool.get("function") or {}
    if not isinstance(function.get("parameters"), dict):
        return tool
    return {**tool, "function": {**function, "parameters": _typed(function["parameters"])}}


def _typed(schema):
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _typed_property(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _typed_property(out["items"])
    return out


def _typed_property(schema):
    if not isinstance(schema, dict):
        return schema
    out = _typed(schema)
    if "type" not in out:
        out["type"] = _implied_type(out)
    return out


def _implied_type(schema: dict) -> str:
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or ():
            if isinstance(branch, dict) and isinstance(branch.get("type"), str):
                return branch["type"]
    enum = schema.get("enum") or ([schema["const"]] if "const" in schema else [])
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "array"}
    if enum and type(enum[0]) in kinds:
        return kinds[type(enum[0])]
    return "string"


def string_arguments(messages, tools):
    """The calls' arguments as JSON text, as OpenAI's API sends them."""
    out = []
    for message in messages:
        if calls := message.get("tool_calls"):
            message = {**message, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                   if isinstance(c["function"]["arguments"], str)
                                   else json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                for c in calls]}
        out.append(message)
    return out, tools


def short_call_ids(messages, tools):
    """Every call id (and the results' ids) as nine letters and digits, the same for
    the same id, so a conversation renders the same every time."""
    def short(call_id):
        if not isinstance(call_id, str):
            return call_id
        digest = int(hashlib.sha256(call_id.encode()).hexdigest(), 16)
        alphabet = string.ascii_letters + string.digits
        return "".join(alphabet[(digest >> (6 * i)) % len(alphabet)] for i in range(9))

    out = []
    for message in messages:
        if calls := message.get("tool_calls"):
            message = {**message, "tool_calls": [{**c, "id": short(c.get("id"))} for c in calls]}
        if "tool_call_id" in message:
            message = {**message, "tool_call_id": short(message["tool_call_id"])}
        out.append(message)
    return out, tools


def later_system_as_user(messages, tools):
    """A system message after the first, joined to the user turn before it (or made
    one), for templates where roles after the first alternate user and assistant."""
    out: list[dict] = []
    for i, message in enumerate(messages):
        if message["role"] == "system" and i > 0 and isinstance(message.get("content"), str):
            if out and out[-1]["role"] == "user" and isinstance(out[-1].get("content"), str):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{message['content']}"}
            else:
                out.append({**message, "role": "user"})
        else:
            out.append(message)
    return out, tools
