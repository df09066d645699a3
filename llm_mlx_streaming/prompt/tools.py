"""Tool calling through the model's own chat template and its family's call format.

llm's tools go to the template as OpenAI-style function specs (`tools=`), earlier
tool calls as the assistant message's `tool_calls`, and tool results as `tool`
messages, which is what Hugging Face chat templates with tool support read. The
model's tool-call markup is in its family's format (formats/: found from the checkpoint
when it loads), cut out of the reply by `split.ReplySplitter` and read by the format's
parser as it is written.

`tool_choice` (auto, none, required or a tool's name) decides what the model may do:
none shows it no tools; required and a name are enforced by constrained decoding
(constrained.py) of the call markup, in the format's own grammar.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from .constrained import COMPILE_OPTIONS, SchemaError, checked_grammar
from ..formats.forcing import literal
from ..formats.registry import format_of

AUTO, NONE, REQUIRED = "auto", "none", "required"


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
    """A ToolError unless a tool-call format was found in the checkpoint (formats/)."""
    if not getattr(tokenizer, "has_tool_calling", False):
        raise ToolError(
            f"{model_name}'s chat template has no tool support (no tool-call format is found in "
            "it or its tokens), so it cannot be given tools (-T)"
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
    `parallel` is not off), in the model's own format: for `choice` required any of
    `tools`, else the one it names. `thinking`: the reply starts inside a think block,
    which it closes before the calls (and opens its answer, where the format writes
    that: `ReasoningMarks.answer`). ToolError for a format that cannot be forced."""
    import llguidance

    check_tool_support(tokenizer)
    fmt = format_of(tokenizer)
    if fmt.grammar is None:
        raise ToolError(f"tool_choice {choice}: this model's tool-call format ({fmt.name}) cannot be "
                        "enforced; use tool_choice auto")
    lark = _Lark(tokenizer)
    picked = [t["function"] for t in tools if choice == REQUIRED or t["function"]["name"] == choice]
    lines = _call_rules(lark, fmt, picked, several=parallel is not False and choice == REQUIRED)
    if thinking:
        think_end = tokenizer.think_end
        never = re.escape(think_end).replace("/", "\\/")
        answer = lark.text(fmt.reasoning.answer) if fmt.reasoning is not None and fmt.reasoning.answer else ""
        lines += [f"start: THOUGHT {lark.text(think_end)} {answer} /\\n{{0,2}}/ calls",
                  f"THOUGHT: /(?s:.*)/ & ~/(?s:.*{never}.*)/"]
    else:
        lines.append("start: calls")
    text = "\n".join(lines)
    return checked_grammar(lambda: llguidance.grammar_from("lark", text), "the tools' parameters")


def answer_or_call_grammar(tokenizer, tools: list[dict], answer: str, message: str) -> Optional[str]:
    """The llguidance grammar of what may follow a reasoning its budget closed, in a format
    that writes its answer behind a header (harmony's final channel): that header
    (`answer`), or a new message (`message`: what the generation prompt begins one with)
    holding a call of `tools`, as a forced call writes it; None where the format's calls
    cannot be forced (nor their parameters compiled)."""
    import llguidance

    fmt = format_of(tokenizer)
    if fmt is None or fmt.grammar is None:
        return None
    lark = _Lark(tokenizer)
    lines = _call_rules(lark, fmt, [t["function"] for t in tools], several=False)
    lines.append(f"start: {lark.text(answer)} | {lark.text(message)} calls")
    try:
        return checked_grammar(lambda: llguidance.grammar_from("lark", "\n".join(lines)), "the tools' parameters")
    except SchemaError:
        return None


def _call_rules(lark: "_Lark", fmt, functions: list[dict], several: bool) -> list[str]:
    """The lark rules of the format's calls of `functions` (one, or one or more when
    `several`), ending with the rule `calls`."""
    start, end = lark.text(fmt.tool_call_start), lark.text(fmt.tool_call_end) if fmt.tool_call_end else ""
    lead = lark.text(fmt.lead) if fmt.lead else ""
    lines = [*fmt.grammar(lark, functions), "call: " + " | ".join(f"call{i}" for i in range(len(functions)))]
    if fmt.blocks:
        lines += [f"block: {lead} {start} call {end}", 'calls: block ("\\n"? block)*' if several else "calls: block"]
    else:
        more = "(/\\n?/ call)*" if several else ""
        lines.append(f"calls: {lead} {start} call {more} {end}")
    return lines


class _Lark:
    """A format's grammar written for this tokenizer: a tag that is one token is that
    token (a special token no text spells), JSON compact as --schema writes it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def tag(self, text: str) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return f"<[{ids[0]}]>" if len(ids) == 1 else literal(text)

    def text(self, text: str) -> str:
        """Text that may hold special tokens (a channel header): each one as its token."""
        added = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)
        parts = re.split("(" + "|".join(map(re.escape, added)) + ")", text) if added else [text]
        return " ".join(self.tag(p) if p in added else literal(p) for p in parts if p)

    def json(self, schema: dict) -> str:
        return f"%json {json.dumps({'x-guidance': COMPILE_OPTIONS, **schema}, ensure_ascii=False)}"


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
    fmt = format_of(tokenizer)
    if fmt is None:
        return None
    try:
        calls = fmt.parse(markup, tools)
    except Exception:  # the model wrote markup its parser cannot read
        return None
    return [{"id": new_call_id(), **call} for call in calls]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallReader:
    """A reply's tool-call blocks, read as they arrive: each call's name as soon as it
    is written and its arguments' JSON in pieces (formats/reading.py), where the format
    can be read so; else each call when its block closes.
    Events: ("name", id, name) and ("arguments", id, JSON text)."""

    def __init__(self, tokenizer, tools: list[dict]):
        self.tokenizer, self.tools = tokenizer, tools
        fmt = format_of(tokenizer)
        self.read = fmt.read if fmt is not None and fmt.reading is not None else None
        self._begin()

    def _begin(self) -> None:
        self.text = ""
        self.given: list[list[str]] = []  # [id, name, arguments' text given] of each call begun

    def piece(self, chunk: str) -> list[tuple]:
        """Events for a piece of the open block."""
        if self.read is None:
            return []
        self.text += chunk
        return self._news(self.read(self.text, False, self.tools))

    def _news(self, written: list[tuple[str, str]]) -> list[tuple]:
        out = []
        for i, (name, arguments) in enumerate(written):
            if i == len(self.given):
                self.given.append([new_call_id(), name, ""])
                out.append(("name", self.given[i][0], name))
            call_id, _, given = self.given[i]
            if len(arguments) > len(given) and arguments.startswith(given):
                out.append(("arguments", call_id, arguments[len(given):]))
                self.given[i][2] = arguments
        return out

    def close(self, inner: str, finished: bool = True) -> Optional[tuple[list[tuple], list[dict]]]:
        """At the end of a block (`finished`: by its end tag or the end of the turn, else
        cut off by the token limit): the events still due and its calls [{"id", "name",
        "arguments"}], or None when nothing of it was given as a call and it does not
        parse (it is text). A call begun but unreadable keeps its text under `_raw`."""
        try:
            parsed = parse_tool_calls(self.tokenizer, inner, self.tools) if finished else None
            if parsed is None and not self.given:
                return None
            events = self._news(self.read(inner, True, self.tools)) if self.read else []
            calls = []
            for i, (call_id, name, given) in enumerate(self.given):
                arguments = parsed[i]["arguments"] if parsed and i < len(parsed) else {"_raw": given}
                calls.append({"id": call_id, "name": name, "arguments": arguments})
            for call in (parsed or [])[len(self.given):]:
                events += [("name", call["id"], call["name"]),
                           ("arguments", call["id"], json.dumps(call["arguments"], ensure_ascii=False))]
                calls.append(call)
            return events, calls
        finally:
            self._begin()
