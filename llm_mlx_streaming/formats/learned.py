"""A tool-call format learned from a chat template (learning.py finds it): the pieces the
template's renderings showed, and the parser, reading and forcing built from them, so
a learned format is a `ToolFormat` like the written ones.

A turn's calls are written as `tool_call_start` `opening` CALL (`separator` CALL)*
`closing` `tool_call_end` (or each CALL in a block of its own, `blocks`), and a CALL in
one of three shapes (llama.cpp's autoparser names them JSON_NATIVE, TAG_WITH_JSON and
TAG_WITH_TAGGED):

- `OBJECT`: a JSON object naming the function and holding its arguments
  (`{"name": ..., "arguments": {...}}`; a JSON list of them where `opening` is "[").
- `JSON_ARGUMENTS`: `head` NAME `after_name` {arguments' JSON} `end`.
- `TAGGED`: `head` NAME `after_name` ARGUMENT (`separator` ARGUMENT)* `end`, each ARGUMENT
  `key_open` KEY `key_close` VALUE `value_close`; the two closes may depend on the value's
  type (DSML's string="true", Kimi-K3's type="number"), and a string's delimiters
  (Gemma's <|"|>, Python's quotes) are part of them.

A piece may hold `COUNTER`, where the template numbers the calls (Kimi-K3's index="1").
Parsing takes each piece as the template wrote it, else with the whitespace around it
left free, so a model that lays its markup out a little differently is still read.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from .forcing import literal, required_parameters
from .reading import json_objects, literal_calls, param_calls
from .tool_format import ReasoningMarks, ToolFormat

COUNTER = "\x00"  # in a piece: a number the template counts the calls with
NAME = r"[\w.\-]+"  # a function's or a parameter's name as the templates write it
OBJECT, JSON_ARGUMENTS, TAGGED = "object", "json_arguments", "tagged"
# The types whose markup may differ, and the JSON schema types each stands for
KINDS = {"string": ("string",), "number": ("integer", "number"), "boolean": ("boolean",),
         "object": ("object",), "array": ("array",)}


@dataclass(frozen=True)
class Tagged:
    """Arguments written one at a time (see the module's docstring); `key_close` and
    `value_close` are ((kind, text), ...) by KINDS; `python`: values other than strings
    are Python literals (True, {'k': 'v'}), else JSON; `by_name`: written in the order
    of their names."""

    key_open: str
    key_close: tuple
    value_close: tuple
    separator: str
    python: bool = False
    by_name: bool = False

    def close(self, kind: str) -> tuple[str, str]:
        return dict(self.key_close)[kind], dict(self.value_close)[kind]


@dataclass(frozen=True)
class Call:
    """One call's shape (see the module's docstring). OBJECT: the object's fields for the
    name and the arguments, `function` the field the two are nested in ("" where they
    are not), `arguments_text` the arguments as JSON text in a string."""

    kind: str
    head: str = ""
    after_name: str = ""
    end: str = ""
    tagged: Optional[Tagged] = None
    name_field: str = "name"
    arguments_field: str = "arguments"
    function: str = ""
    arguments_text: bool = False


@dataclass(frozen=True)
class Learned:
    """What a template showed of its calls and reasoning, with mlx-lm's parser interface
    (`tool_call_start`, `tool_call_end`, `parse_tool_call`) over one block's markup."""

    tool_call_start: str
    tool_call_end: str
    call: Call
    opening: str = ""
    closing: str = ""
    separator: str = ""
    blocks: bool = False
    reasoning: Optional[ReasoningMarks] = None

    def parse_tool_call(self, text: str, tools: Any = None):
        calls = _objects(self.call, text) if self.call.kind == OBJECT else _calls(self, text, tools)
        if not calls:
            raise ValueError("No tool call found.")
        return calls


def learned_format(learned: Learned) -> ToolFormat:
    """The ToolFormat of a learned format: its parser is the `Learned` itself."""
    return ToolFormat(
        name="learned",
        parser=learned,
        reading=_reading(learned),
        grammar=functools.partial(_grammar, learned),
        blocks=learned.blocks or bool(learned.separator.strip()),
        reasoning=learned.reasoning,
        origin="learned",
    )


# -- parsing -------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _pattern(piece: str, exact: bool) -> re.Pattern:
    """A piece as a regex: as written, or with the whitespace around it free."""
    body = piece if exact else piece.strip()
    regex = r"\d+".join(map(re.escape, body.split(COUNTER)))
    return re.compile(regex if exact else rf"\s*{regex}", re.S)


@functools.lru_cache(maxsize=None)
def _closing(piece: str) -> re.Pattern:
    """What closes a value, its own leading whitespace optional (a model may end a value
    on the same line)."""
    core = piece.strip()
    lead = piece[:piece.index(core)] if core else ""
    return re.compile((f"(?:{re.escape(lead)})?" if lead else "") + r"\d+".join(map(re.escape, core.split(COUNTER))), re.S)


class _Cursor:
    """A position in a block's markup, moved on by the pieces found there."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def take(self, piece: str) -> bool:
        if not piece:
            return True
        match = _pattern(piece, True).match(self.text, self.at) or _pattern(piece, False).match(self.text, self.at)
        if match:
            self.at = match.end()
        return match is not None

    def name(self) -> Optional[str]:
        match = re.compile(NAME).match(self.text, self.at)
        if match:
            self.at = match.end()
        return match.group() if match else None

    def until(self, piece: str) -> Optional[str]:
        """The text up to `piece` (as written, else its markup with or without the
        whitespace it starts with), which is taken."""
        match = _pattern(piece, True).search(self.text, self.at) or _closing(piece).search(self.text, self.at)
        if match is None:
            return None
        found, self.at = self.text[self.at:match.start()], match.end()
        return found


def _calls(learned: Learned, text: str, tools) -> list[dict]:
    cursor, calls = _Cursor(text), []
    cursor.take(learned.opening)
    while True:
        start = cursor.at
        if calls and not cursor.take(learned.separator):
            break
        call = _call(learned.call, cursor, tools)
        if call is None:
            cursor.at = start
            break
        calls.append(call)
    return calls


def _call(call: Call, cursor: _Cursor, tools) -> Optional[dict]:
    if not cursor.take(call.head):
        return None
    name = cursor.name()
    if name is None or not cursor.take(call.after_name):
        return None
    if call.kind == JSON_ARGUMENTS:
        arguments = _json_at(cursor)
        if not isinstance(arguments, dict):
            return None
    else:
        arguments = _arguments(call.tagged, cursor, name, tools)
        if arguments is None:
            return None
    cursor.take(call.end)  # a call cut off before its end (a streamed one) is read as far as it goes
    return dict(name=name, arguments=arguments)


def _arguments(tagged: Tagged, cursor: _Cursor, name: str, tools) -> Optional[dict]:
    arguments: dict = {}
    while True:
        start = cursor.at
        if arguments and not cursor.take(tagged.separator):
            break
        if not cursor.take(tagged.key_open):
            cursor.at = start
            break
        key = cursor.name()
        if key is None:
            return None
        for kind, close in sorted(tagged.key_close, key=lambda kc: -len(kc[1].strip())):
            if cursor.take(close):
                break
        else:
            return None
        value = _value(tagged, kind, cursor)
        if value is None:
            return None
        arguments[key] = _typed(value, _schema_type(tools, name, key), _unique(tagged, kind))
    return arguments


def _unique(tagged: Tagged, kind: str) -> Optional[str]:
    """The kind a value's markup says it is, where no other kind shares its key close."""
    close = dict(tagged.key_close)[kind]
    return kind if sum(1 for _, c in tagged.key_close if c == close) == 1 else None


def _value(tagged: Tagged, kind: str, cursor: _Cursor) -> Optional[str]:
    """A value's text: up to its closing markup, or, where it has none (a literal
    syntax), up to the next argument or the call's end, outside strings and brackets."""
    close = dict(tagged.value_close)[kind]
    if close.strip():
        return cursor.until(close)
    text, at, depth, quote = cursor.text, cursor.at, 0, None
    stops = tuple(s for s in (tagged.separator.strip(), ")", "}", "]") if s)
    while at < len(text):
        char = text[at]
        if quote:
            quote = None if char == quote and text[at - 1] != "\\" else quote
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif depth and char in ")]}":
            depth -= 1
        elif not depth and text.startswith(stops, at):
            break
        at += 1
    found, cursor.at = text[cursor.at:at], at
    return found


def _typed(value: str, schema_type: Optional[str], kind: Optional[str]):
    """A value as its markup or the function's schema says it is: a string as written,
    anything else read as JSON (or a Python literal), else left as text."""
    if kind == "string" or (kind is None and schema_type == "string"):
        return value
    for read in (json.loads, ast.literal_eval):
        try:
            return read(value.strip())
        except (ValueError, SyntaxError):
            continue
    return value


def _schema_type(tools, name: str, key: str) -> Optional[str]:
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if function.get("name") == name:
            return (((function.get("parameters") or {}).get("properties") or {}).get(key) or {}).get("type")
    return None


def _json_at(cursor: _Cursor):
    """The JSON value at the cursor (whitespace skipped), taken; None where there is none."""
    text = cursor.text
    at = len(text) - len(text[cursor.at:].lstrip())
    try:
        value, end = json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return None
    cursor.at = end
    return value


def json_values(text: str) -> list[tuple[int, int, object]]:
    """The JSON objects and lists written in a text: (start, end, value) each."""
    values, at = [], 0
    while (found := re.compile(r"[\[{]").search(text, at)) is not None:
        try:
            value, end = json.JSONDecoder().raw_decode(text, found.start())
        except ValueError:
            at = found.start() + 1
            continue
        values.append((found.start(), end, value))
        at = end
    return values


def _objects(call: Call, text: str) -> list[dict]:
    """The calls among the JSON values in a block: objects naming a function, alone or in
    lists."""
    calls = []
    for _, _, value in json_values(text):
        for item in value if isinstance(value, list) else [value]:
            found = _object_call(call, item)
            if found is not None:
                calls.append(found)
    return calls


def _object_call(call: Call, item) -> Optional[dict]:
    fields = item.get(call.function) if call.function and isinstance(item, dict) else item
    if not isinstance(fields, dict) or not isinstance(fields.get(call.name_field), str):
        return None
    arguments = fields.get(call.arguments_field, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return dict(name=fields[call.name_field], arguments=arguments) if isinstance(arguments, dict) else None


# -- reading while written -------------------------------------------------------------

def _loose(piece: str) -> str:
    """A piece as a regex with the whitespace around it free (for a call's head)."""
    return _pattern(piece, False).pattern + r"\s*" if piece.strip() else r"\s*"


def _reading(learned: Learned):
    call = learned.call
    if call.kind == OBJECT:
        if call.function or call.arguments_text:
            return None
        return json_objects(rf'\{{\s*"{re.escape(call.name_field)}"\s*:\s*"(?P<name>{NAME})"\s*,'
                            rf'\s*"{re.escape(call.arguments_field)}"\s*:\s*')
    head = (r"\A" if learned.blocks else "") + _loose(call.head) + f"(?P<name>{NAME})"
    marked = bool(call.head.strip()) or learned.blocks  # something but a name says where a call begins
    if call.kind == JSON_ARGUMENTS:
        return json_objects(head + _loose(call.after_name)) if marked else None
    tagged = call.tagged
    closes = {c.strip() for _, c in tagged.value_close}
    if all(closes):
        if not marked:
            return None
        named = _loose(call.after_name) if call.after_name.strip() else r"(?=[\s<\[({])"  # the name is whole
        closed = "|".join(_pattern(c, False).pattern for c in sorted(closes, key=len, reverse=True))
        return param_calls(head + named, f"(?:{closed})", call.end)
    opens, ends = call.after_name.strip(), call.end.strip()
    if opens[-1:] in ("(", "{") and ends[:1] == {"(": ")", "{": "}"}[opens[-1]]:  # a literal syntax in brackets
        quotes = tuple(sorted({_string_quote(tagged), '"'} - {""}, key=len, reverse=True))
        return literal_calls(head + _loose(call.after_name), quotes, True,
                             lambda name, arguments: f"{call.head}{name}{call.after_name}{arguments}{call.end}")
    return None


def _string_quote(tagged: Tagged) -> str:
    """What opens a string value, where the key's close says so (Gemma's <|"|>, "'")."""
    string, number = dict(tagged.key_close)["string"], dict(tagged.key_close)["number"]
    return string[len(number):].strip() if string.startswith(number) else ""


# -- forcing ---------------------------------------------------------------------------

def _pieces(lark, text: str) -> str:
    """A piece as lark: its special tokens as tokens, a counter as digits."""
    parts = [lark.text(part) if part else "" for part in text.split(COUNTER)]
    return " /[0-9]+/ ".join(parts).strip() if len(parts) > 1 else parts[0]


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p) or literal("")


def _around(lark, learned: Learned, core: str) -> str:
    """A forced call with what a block writes around it: as the template does for a call
    in a block of its own, optional layout where calls share one."""
    if learned.blocks or learned.separator.strip():
        return _join(_pieces(lark, learned.opening), core, _pieces(lark, learned.closing))
    loose = lambda s: f"{literal(s)}?" if s and not s.strip() else ""  # noqa: E731
    return _join(loose(learned.opening), core, loose(learned.closing))


def _grammar(learned: Learned, lark, functions: list[dict]) -> list[str]:
    call, lines = learned.call, []
    for i, function in enumerate(functions):
        name, schema = function["name"], function.get("parameters") or {"type": "object"}
        if call.kind == OBJECT:
            core = lark.json({"type": "object", "additionalProperties": False,
                              "required": [call.name_field, call.arguments_field],
                              "properties": {call.name_field: {"const": name}, call.arguments_field: schema}})
        elif call.kind == JSON_ARGUMENTS:
            lines.append(f"arguments{i}: {lark.json(schema)}")
            core = _join(_pieces(lark, call.head + name + call.after_name), f"arguments{i}", _pieces(lark, call.end))
        else:
            core = _join(_pieces(lark, call.head + name + call.after_name),
                         _parameters(lark, call.tagged, function, i, lines), _pieces(lark, call.end))
        lines.append(f"call{i}: {_around(lark, learned, core)}")
    return lines


def _string_rule(lark, value: str, close: str, lines: list) -> str:
    """The rule of a forced string value (text without markup) that its `close` ends,
    and what of the close is left to write after it. A close that starts with layout
    (Qwen3-Coder's line break before </parameter>) and holds no special token is one
    lexeme with the value, which ends where it first comes; one that starts with text
    (a quote) keeps that character out of the value."""
    if close[:1].isspace() and COUNTER not in close and lark.text(close) == literal(close):
        lines.append(f"{value}[lazy]: /[^<]*/ {literal(close)}")
        return ""
    close = close.lstrip()
    stop = close[:1] if close[:1] not in ("", "<") else ""
    stop = "\\" + stop if stop in "]\\^/-" and stop else stop  # as a character class in lark writes it
    lines.append(f"{value}: /[^<{stop}]*/")
    return close


def _parameters(lark, tagged: Tagged, function: dict, i: int, lines: list) -> str:
    """The required parameters of a forced call, each in the markup of its type."""
    parameters = required_parameters(function)
    if tagged.by_name:
        parameters = sorted(parameters, key=lambda p: p[0])
    parts = []
    for j, (key, spec) in enumerate(parameters):
        kind = next((k for k, types in KINDS.items() if spec.get("type") in types), "object")
        key_close, value_close = tagged.close(kind)
        value = f"value{i}_{j}"
        if kind == "string":
            value_close = _string_rule(lark, value, value_close, lines)
        elif kind == "boolean" and tagged.python:
            lines.append(f"{value}: /True|False/")
        else:
            lines.append(f"{value}: {lark.json(spec)}")
        parts.append(_join(_pieces(lark, tagged.key_open + key + key_close), value, _pieces(lark, value_close)))
    return f" {_pieces(lark, tagged.separator)} ".join(parts) if tagged.separator else " ".join(parts)
