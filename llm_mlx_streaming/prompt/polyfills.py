"""A real client's conversation through a real model's chat template: what the template
reads but the client did not send (or sent in another shape) is filled in, as the
model's publishers' reference code and llama.cpp's template polyfills do, and only where
the template needs it, so a template that renders the request as it is sees it as it is.

Every fill-in takes and returns (tokenizer, messages, tools) -> (messages, tools), and
FILL_INS says, in order, when each applies; `fill_in` alone decides. Those read off the
template come first; the rest apply after a render that shows the template needs them,
each kept while the later ones are tried (a conversation may need several).
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..formats.registry import format_of
from .messages import PromptError

Render = Callable[[list[dict], Optional[list[dict]]], str]
FillIn = Callable[[object, list[dict], Optional[list[dict]]], tuple[list[dict], Optional[list[dict]]]]


@dataclass
class Fitting:
    """A conversation being fitted to one template: the messages and tools so far, and
    their render (made when a condition first asks for it)."""

    tokenizer: object
    messages: list[dict]
    tools: Optional[list[dict]]
    render: Render
    _rendered: Optional[tuple[Optional[str], Optional[Exception]]] = field(default=None, repr=False)

    @property
    def template(self) -> str:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else ""

    @property
    def rendered(self) -> tuple[Optional[str], Optional[Exception]]:
        """(the text, None) or (None, the template's error)."""
        if self._rendered is None:
            try:
                self._rendered = (self.render(self.messages, self.tools), None)
            except Exception as exc:  # the template's own error, whatever its type
                self._rendered = (None, exc)
        return self._rendered

    def apply(self, fill: FillIn) -> None:
        fixed = fill(self.tokenizer, self.messages, self.tools)
        if fixed != (self.messages, self.tools):
            self.messages, self.tools = fixed
            self._rendered = None


def reads(pattern: str) -> Callable[[Fitting], bool]:
    """The template's text matches `pattern`."""
    return lambda fit: re.search(pattern, fit.template) is not None


def lacks(pattern: str) -> Callable[[Fitting], bool]:
    """The template's text does not match `pattern`."""
    return lambda fit: re.search(pattern, fit.template) is None


def always(fit: Fitting) -> bool:
    return True


def fails(fit: Fitting) -> bool:
    """The template cannot render the conversation as it is now."""
    return fit.rendered[1] is not None


def fails_or_drops_a_system_message(fit: Fitting) -> bool:
    """The template fails, or leaves out the text of a system message after the first of
    those the conversation opens with (gpt-oss's, MiniMax-M2's and DeepSeek-V3.2's render
    the first only)."""
    text, error = fit.rendered
    opening = _opening_system(fit.messages)
    return error is not None or (len(opening) > 1 and any(m["content"] not in text for m in opening))


def fill_in(tokenizer, messages: list[dict], tools: Optional[list[dict]],
           render: Render) -> tuple[list[dict], Optional[list[dict]], str]:
    """(messages, tools) as this template renders them, and what it renders; a
    PromptError in one line when it cannot render them at all."""
    fit = Fitting(tokenizer, messages, tools, render)
    for applies, fill in FILL_INS:
        if applies(fit):
            fit.apply(fill)
    text, failure = fit.rendered
    if failure is not None:
        raise PromptError(f"the model's chat template cannot render this conversation: "
                          f"{type(failure).__name__}: {_line(failure)}") from None
    return fit.messages, fit.tools, text


def _line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text[:300]


def fold_tool_responses(tokenizer, messages: list[dict], tools):
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
    return out, tools


def _json_or_text(content):
    if isinstance(content, str):
        try:
            value = json.loads(content)
        except ValueError:
            return content
        return value if isinstance(value, dict) else content
    return content


def inline_calls(tokenizer, messages: list[dict], tools):
    """Earlier calls written after the turn's text in the format's markup, for a
    template that renders only text."""
    fmt = format_of(tokenizer)
    if fmt is None or fmt.write is None or not any(m.get("tool_calls") for m in messages):
        return messages, tools
    out = []
    for message in messages:
        if calls := message.get("tool_calls"):
            written = fmt.write([(c.get("id"), c["function"]["name"], _as_dict(c["function"]["arguments"]))
                                 for c in calls])
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = (message.get("content") or "") + written
        out.append(message)
    return out, tools


def rename_call_ids(tokenizer, messages: list[dict], tools):
    """Each call's id as the model would have written it (numbered through the
    conversation), and its result's id with it, for a format that names its calls."""
    fmt = format_of(tokenizer)
    if fmt is None or fmt.call_id is None or not any(m.get("tool_calls") for m in messages):
        return messages, tools
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
    return out, tools


def declare_tools(tokenizer, messages: list[dict], tools):
    """The format's description of the tools after the first system message's text (a
    system message of its own where there is none), for a template that renders no
    `tools`; the same place every turn, so the prompt's start stays the same."""
    fmt = format_of(tokenizer)
    if not tools or fmt is None or fmt.declare is None:
        return messages, tools
    declaration = fmt.declare(tools)
    if messages and messages[0]["role"] == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{declaration}"}, *messages[1:]], tools
    return [{"role": "system", "content": declaration}, *messages], tools


def _as_dict(arguments):
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def type_properties(tokenizer, messages, tools):
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


def stringify_arguments(tokenizer, messages, tools):
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


def shorten_call_ids(tokenizer, messages, tools):
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


def move_later_system_to_user(tokenizer, messages, tools):
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


def join_opening_system(tokenizer, messages, tools):
    """The system messages the conversation opens with (the Responses API's instructions
    and developer items) as one, for templates that take a single system message."""
    opening = _opening_system(messages)
    if len(opening) < 2:
        return messages, tools
    joined = "\n\n".join(m["content"] for m in opening)
    return [{"role": "system", "content": joined}, *messages[len(opening):]], tools


def _opening_system(messages: list[dict]) -> list[dict]:
    opening = []
    for message in messages:
        if message["role"] != "system" or not isinstance(message.get("content"), str):
            break
        opening.append(message)
    return opening


# (when it applies, what it does), in the order they are applied
FILL_INS: tuple[tuple[Callable[[Fitting], bool], FillIn], ...] = (
    # read off the template
    (reads("tool_responses"), fold_tool_responses),  # Gemma 4 reads results in the calling turn
    (always, rename_call_ids),  # Kimi-K2 names its calls functions.NAME:i (a no-op for other formats)
    (lacks("tool_calls"), inline_calls),  # Kimi-K2 Instruct's template renders only text
    (lacks(r"\btools\b"), declare_tools),  # DeepSeek-V3.1's model card has the caller describe them
    # shown by a render
    (fails, type_properties),  # Gemma 4 reads value['type']; Claude Code's tools leave it out
    (fails, stringify_arguments),  # DeepSeek-V3.1's template concatenates them
    (fails, shorten_call_ids),  # Mistral's template refuses ids other than nine letters and digits
    (fails_or_drops_a_system_message, join_opening_system),  # Mistral fails, gpt-oss drops the second
    (fails, move_later_system_to_user),  # Mistral takes a system message only first (Claude Code sends one later)
)
