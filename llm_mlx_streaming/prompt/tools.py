"""Tool calling through the model's own chat template and mlx-lm's tool parsers.

llm's tools go to the template as OpenAI-style function specs (`tools=`), earlier
tool calls as the assistant message's `tool_calls`, and tool results as `tool`
messages, which is what Hugging Face chat templates with tool support read. The
model's tool-call markup (`tokenizer.tool_call_start` ... `tool_call_end`, found by
mlx-lm from the template) is cut out of the reply by `split.ReplySplitter` and
parsed by the tokenizer's `tool_parser`, the same parser `mlx_lm.server` uses.

`tool_choice` (auto, none, required or a tool's name) decides what the model may do:
none shows it no tools; required and a name are enforced by constrained decoding
(constrained.py) of the call markup, for the formats whose call is a JSON object
between the markup tags.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional

from .constrained import COMPILE_OPTIONS, checked_grammar

AUTO, NONE, REQUIRED = "auto", "none", "required"
# mlx-lm tool parsers whose call is {"name": ..., "arguments": {...}} between the tags
JSON_CALL_PARSERS = ("mlx_lm.tool_parsers.json_tools",)
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
HELD_BACK = re.compile(r"\}?\s*$")  # what may still turn out to close the call, not its arguments
CALL_END = re.compile(r"\}\s*$")


class ToolError(ValueError):
    """The model cannot take the tools it was given; the message is one line."""


def template_tools(tools) -> list[dict]:
    """llm `Tool`s as the function specs chat templates expect."""
    return [function_spec(tool.name, tool.description, tool.input_schema) for tool in tools]


def function_spec(name: str, description: Optional[str], parameters: Optional[dict]) -> dict:
    """One function as chat templates (and OpenAI's `tools`) describe it."""
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters or {"type": "object", "properties": {}}}}


def function_tools(prompt) -> list:
    """The prompt's tools that the model calls (llm's server-side tools are not ours)."""
    import llm

    return [t for t in (prompt.tools or []) if isinstance(t, llm.Tool)]


def check_tool_support(tokenizer, model_name: str = "this model") -> None:
    """A ToolError unless mlx-lm found a tool-call format in the chat template."""
    if not getattr(tokenizer, "has_tool_calling", False):
        raise ToolError(
            f"{model_name}'s chat template has no tool support (mlx-lm finds no tool-call "
            "format in it), so it cannot be given tools (-T)"
        )


def shown_tools(tools: list[dict], choice: Optional[str]) -> list[dict]:
    """The function specs the template renders: none for tool_choice none."""
    return [] if choice == NONE else tools


def check_tool_choice(choice: Optional[str], tools: list[dict]) -> None:
    """A ToolError unless `choice` can be honoured with `tools`."""
    if choice in (None, AUTO, NONE):
        return
    names = [t["function"]["name"] for t in tools]
    if not names:
        raise ToolError(f"tool_choice {choice}: no tools were given")
    if choice != REQUIRED and choice not in names:
        raise ToolError(f"tool_choice {choice!r}: no tool has that name (the tools: {', '.join(names)})")


def forced_call_grammar(tokenizer, tools: list[dict], choice: str, parallel: Optional[bool] = None,
                        thinking: bool = False) -> str:
    """The llguidance grammar that makes the reply tool calls (one, or one or more when
    `parallel` is not off): for `choice` required any of `tools`, else the one it names.
    `thinking`: the reply starts inside a think block, which it closes before the calls.
    ToolError for a format it cannot force."""
    import llguidance

    check_tool_support(tokenizer)
    parser = _parser(tokenizer)
    if parser not in JSON_CALL_PARSERS:
        raise ToolError(f"tool_choice {choice}: this model's tool-call format ({parser}) cannot be "
                        "enforced; use tool_choice auto")
    picked = [t["function"] for t in tools if choice == REQUIRED or t["function"]["name"] == choice]
    schema = {
        "x-guidance": COMPILE_OPTIONS,
        "anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                   "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}}
                  for f in picked],
    }
    start, end = _markup(tokenizer, tokenizer.tool_call_start), _markup(tokenizer, tokenizer.tool_call_end)
    several = parallel is not False and choice == REQUIRED
    lines = [
        'calls: call ("\\n"? call)*' if several else "calls: call",
        f'call: {start} "\\n" arguments "\\n" {end}',
        f"arguments: %json {json.dumps(schema, ensure_ascii=False)}",
    ]
    if thinking:
        think_end = tokenizer.think_end
        never = re.escape(think_end).replace("/", "\\/")
        lines += [f"start: THOUGHT {_markup(tokenizer, think_end)} /\\n{{0,2}}/ calls",
                  f"THOUGHT: /(?s:.*)/ & ~/(?s:.*{never}.*)/"]
    else:
        lines.append("start: calls")
    lark = "\n".join(lines)
    return checked_grammar(lambda: llguidance.grammar_from("lark", lark), "the tools' parameters")


def _parser(tokenizer) -> Optional[str]:
    """The module of the tokenizer's mlx-lm tool parser."""
    return getattr(getattr(tokenizer, "tool_parser", None), "__module__", None)


def _markup(tokenizer, tag: str) -> str:
    """A markup tag in the grammar: the token it is, when it is one (it may be a special
    token, which no text spells), else its text."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(tag, ensure_ascii=False)


def assistant_tool_calls(parts) -> list[dict]:
    """An assistant message's tool calls, as the template's `tool_calls`."""
    from llm.parts import ToolCallPart

    return [
        {
            "id": part.tool_call_id,
            "type": "function",
            "function": {"name": part.name, "arguments": part.arguments or {}},
        }
        for part in parts
        if isinstance(part, ToolCallPart) and not part.server_executed
    ]


def tool_result_messages(message) -> list[dict]:
    """A `tool` message's results, one template message each."""
    from llm.parts import ToolResultPart

    out = []
    for part in message.parts:
        if not isinstance(part, ToolResultPart):
            raise ToolError(f"mlx-stream cannot send {type(part).__name__} in a tool message")
        content = part.output if not part.exception else f"Error: {part.exception}"
        out.append({"role": "tool", "content": content, "name": part.name, "tool_call_id": part.tool_call_id})
    return out


def parse_tool_calls(tokenizer, markup: str, tools: list[dict]) -> Optional[list[dict]]:
    """[{"id", "name", "arguments"}] from one tool-call block; None if it does not parse."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        return None
    try:
        parsed: Any = parser(markup, tools)
    except Exception:  # the model wrote markup its parser cannot read
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        out.append({"id": new_call_id(), "name": call["name"], "arguments": arguments})
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallReader:
    """A reply's tool-call blocks, read as they arrive. Where the call is
    {"name": ..., "arguments": ...} (JSON_CALL_PARSERS) the name is given as soon as it
    is written and the arguments' text as it is generated (what may be the call's own
    closing brace held back); other formats give each call when its block is closed.
    Events: ("name", id, name) and ("arguments", id, JSON text)."""

    def __init__(self, tokenizer, tools: list[dict]):
        self.tokenizer, self.tools = tokenizer, tools
        self.streams = _parser(tokenizer) in JSON_CALL_PARSERS
        self._begin()

    def _begin(self) -> None:
        self.text, self.id, self.name, self.start, self.sent = "", None, "", 0, 0

    def piece(self, chunk: str) -> list[tuple]:
        """Events for a piece of the open block."""
        if not self.streams:
            return []
        self.text += chunk
        out = []
        if self.id is None:
            head = CALL_HEAD.match(self.text)
            if head is None:
                return []
            self.id, self.name, self.start = new_call_id(), json.loads(head.group(1)), head.end()
            out.append(("name", self.id, self.name))
        body = self.text[self.start:]
        certain = HELD_BACK.search(body).start()
        if certain > self.sent:
            out.append(("arguments", self.id, body[self.sent:certain]))
            self.sent = certain
        return out

    def close(self, inner: str, finished: bool = True) -> Optional[tuple[list[tuple], list[dict]]]:
        """At the end of a block (`finished`: by its end tag, else cut off by the end of
        the reply): the events still due and its calls [{"id", "name", "arguments"}], or
        None when nothing of it was given as a call and it does not parse (it is text)."""
        try:
            if self.id is not None:
                body = inner[self.start:]
                text = CALL_END.sub("", body, count=1) if finished else body
                parsed = parse_tool_calls(self.tokenizer, inner, self.tools) if finished else None
                arguments = parsed[0]["arguments"] if parsed and len(parsed) == 1 else {"_raw": text}
                return ([("arguments", self.id, text[self.sent:])],
                        [{"id": self.id, "name": self.name, "arguments": arguments}])
            calls = parse_tool_calls(self.tokenizer, inner, self.tools) if finished else None
            if not calls:
                return None
            events = [e for c in calls for e in (("name", c["id"], c["name"]),
                                                  ("arguments", c["id"], json.dumps(c["arguments"])))]
            return events, calls
        finally:
            self._begin()
