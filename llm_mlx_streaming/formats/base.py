"""What a tool-call format is: its markup and parser (mlx-lm's `tool_parsers/` shape:
`tool_call_start`, `tool_call_end`, `parse_tool_call(text, tools)`), how to read its
calls while they are still being written, how to force one, and how it is recognised
when mlx-lm's own inference misses it.

Calls are streamed as OpenAI's clients expect them, a name and then the arguments as
JSON text in pieces whose concatenation is the whole arguments' JSON. Three shapes cover
the families: the arguments are JSON in the markup (`json_calls`: streamed as written),
they are written one parameter at a time in markup (`param_calls`), or in a literal
syntax of the format's own (`literal_calls`: Python's keywords, Gemma's objects); in
the last two each parameter is streamed once complete, read by the format's own parser,
so the values are typed as it types them.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from ..stops import partial_suffix

# (markup so far, whether the block is closed, the tools) -> [(name, arguments' JSON text so far)]
Reading = Callable[[str, bool, Optional[list]], list[tuple[str, str]]]
# (the grammar's writer, functions [{"name", "parameters"}]) -> lark rules call0, call1, ... (one call each)
Grammar = Callable[["Lark", list[dict]], list[str]]


@dataclass(frozen=True)
class ReasoningMarks:
    """Where a reply's reasoning is, as text: the block opens at `start` and ends at
    `end`, and `answer` is what the format writes after the end to begin the answer
    (harmony's final-channel header; "" where the answer simply follows). A thinking
    budget closes the block by forcing `end` + `answer`."""

    start: str
    end: str
    answer: str = ""


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call format. `parser` names a module with mlx-lm's parser
    interface. `reading` and `grammar` are None where calls are given whole when their
    block closes and cannot be forced. `detect(template, vocab)` recognises the format
    where mlx-lm's inference does not. `response_format` is mlx-lm's text-state-machine
    spec for formats that write in channels (harmony). `blocks`: each call is its own
    block (start ... end), else all the turn's calls share one. `write`: calls in the
    markup, start and end included, for a template that renders no `tool_calls`.
    `call_id`: where the model names its calls itself (Kimi's functions.NAME:i), the id
    its template expects back for the conversation's i-th call. `declare`: the tools
    described as the model's publishers have the system prompt describe them, for a
    template that renders no `tools`. `reasoning`: where a format that writes in
    channels reasons (think tags are mlx-lm's to find)."""

    name: str
    parser: str
    reading: Optional[Reading] = None
    grammar: Optional[Grammar] = None
    detect: Optional[Callable[[str, dict], bool]] = None
    response_format: Optional[dict] = None
    blocks: bool = True
    lead: str = ""  # what the reply writes before a call's start tag (harmony's channel header)
    write: Optional[Callable[[list[tuple[str, str, dict]]], str]] = None  # calls (id, name, arguments) as written
    call_id: Optional[Callable[[str, int], str]] = None  # the id the model gives the conversation's i-th call
    declare: Optional[Callable[[list[dict]], str]] = None  # function specs -> their description
    reasoning: Optional[ReasoningMarks] = None

    @property
    def module(self):
        return importlib.import_module(self.parser)

    @property
    def start(self) -> str:
        return self.module.tool_call_start

    @property
    def end(self) -> str:
        return self.module.tool_call_end

    def parse(self, text: str, tools: Optional[list]) -> list[dict]:
        """[{"name", "arguments" (a dict)}] of one block; ValueError if it holds no call."""
        parsed: Any = self.module.parse_tool_call(text, tools)
        calls = parsed if isinstance(parsed, list) else [parsed]
        out = []
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError(f"not a call: {call!r}")
            arguments = call.get("arguments")
            if arguments is None:
                arguments = {}
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError(f"arguments that are not an object: {arguments!r}")
            out.append({"name": call["name"], "arguments": arguments})
        if not out:
            raise ValueError("no call")
        return out


def json_calls(head: str, call_end: str = "", tail: str = r"\s*", held: str = r"\s*") -> Reading:
    """Calls written as a head naming the function (`head`, a regex with a group
    `name`) followed by the arguments' JSON, which ends at `call_end`, the next head or
    the end of the block; `tail` is what follows the JSON there (stripped), `held` what
    may still turn out to be that tail while the block is open (held back)."""
    heads = re.compile(head, re.S)
    tail_re, held_re = re.compile(f"(?:{tail})\\Z", re.S), re.compile(f"(?:{held})\\Z", re.S)

    def reading(text: str, closed: bool, tools=None) -> list[tuple[str, str]]:
        found = list(heads.finditer(text))
        out = []
        for i, match in enumerate(found):
            stop = found[i + 1].start() if i + 1 < len(found) else len(text)
            region = text[match.end():stop]
            ended = closed or i + 1 < len(found)
            if call_end and call_end in region:
                region, ended = region[: region.index(call_end)], True
            elif not ended and call_end:
                region = region[: len(region) - partial_suffix(region, call_end)]
            cut = (tail_re.search(region) if ended else None) or held_re.search(region)
            region = region[: cut.start()]
            out.append((match.group("name"), region))
        return out

    return reading


def param_calls(head: str, closed_parameter: str, closing: str) -> Callable[[str], Reading]:
    """For a format whose calls write one parameter at a time: a call starts at `head`
    (a regex with a group `name`), a parameter is complete at the end of a match of
    `closed_parameter`, and `closing` completes a call cut after a parameter so the
    format's parser reads it. Given the format's parser module path, the Reading."""
    heads, params = re.compile(head, re.S), re.compile(closed_parameter, re.S)

    def for_parser(parser: str) -> Reading:
        def reading(text: str, closed: bool, tools=None) -> list[tuple[str, str]]:
            module = importlib.import_module(parser)
            found = list(heads.finditer(text))
            out = []
            for i, match in enumerate(found):
                stop = found[i + 1].start() if i + 1 < len(found) else len(text)
                region = text[match.start():stop]
                ended = closed or i + 1 < len(found)
                if not ended:
                    last = None
                    for last in params.finditer(region):
                        pass
                    region = (region[: last.end()] if last else region[: match.end() - match.start()]) + closing
                try:
                    parsed = module.parse_tool_call(region, tools)
                except Exception:  # not yet a call its parser reads
                    parsed = None
                call = parsed[0] if isinstance(parsed, list) and parsed else parsed
                arguments = call.get("arguments") if isinstance(call, dict) else None
                if not isinstance(arguments, dict):
                    if ended:
                        break
                    arguments = {}
                text_so_far = json.dumps(arguments, ensure_ascii=False)
                out.append((match.group("name"), text_so_far if ended else text_so_far[:-1]))
            return out

        return reading

    return for_parser


def literal_calls(head: str, quotes: tuple[str, ...], escapes: bool, call: Callable[[str, str], str]
                  ) -> Callable[[str], Reading]:
    """For a format that writes a call as a name and its arguments in a literal syntax
    of its own (Python's keywords, Gemma's objects): a call starts at `head` (a regex with
    a group `name`, ending at the bracket that opens the arguments); its arguments run to
    the matching bracket, parameters apart at the commas outside strings (delimited by
    any of `quotes`, a backslash escaping where `escapes`) and brackets. Each parameter
    is streamed once the next begins, read by the format's parser from `call(name,
    the parameters so far)`. Given the parser's module path, the Reading."""
    heads = re.compile(head, re.S)

    def for_parser(parser: str) -> Reading:
        def reading(text: str, closed: bool, tools=None) -> list[tuple[str, str]]:
            module = importlib.import_module(parser)
            out, at = [], 0
            while match := heads.search(text, at):
                commas, end = bracketed(text, match.end(), quotes, escapes)
                done = text[match.end():end if end is not None else (commas[-1] if commas else match.end())]
                try:
                    parsed = module.parse_tool_call(call(match.group("name"), done), tools)
                    arguments = (parsed[0] if isinstance(parsed, list) else parsed)["arguments"]
                except Exception:  # not yet arguments its parser reads
                    arguments = None
                if not isinstance(arguments, dict):
                    if end is not None:
                        break
                    arguments = {}
                text_so_far = json.dumps(arguments, ensure_ascii=False)
                out.append((match.group("name"), text_so_far if end is not None else text_so_far[:-1]))
                if end is None:
                    break
                at = end + 1
            return out

        return reading

    return for_parser


def bracketed(text: str, start: int, quotes: tuple[str, ...], escapes: bool) -> tuple[list[int], Optional[int]]:
    """From just inside an opening bracket: where the commas between its items are, and
    where its closing bracket is (None while it is not written); strings (between any of
    `quotes`, a backslash escaping where `escapes`) and nested brackets are skipped."""
    marks, strings = _syntax(quotes, escapes)
    commas, depth, i = [], 1, start
    while mark := marks.search(text, i):
        char, i = mark.group(), mark.end()
        if char in strings:
            string = strings[char].match(text, i)
            if string is None:
                return commas, None
            i = string.end()
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return commas, mark.start()
        elif depth == 1:
            commas.append(mark.start())
    return commas, None


@functools.lru_cache(maxsize=None)
def _syntax(quotes: tuple[str, ...], escapes: bool):
    """The marks `bracketed` stops at (brackets, commas, a string's opening), and for
    each opening the rest of its string."""
    marks = re.compile("|".join(map(re.escape, sorted(quotes, key=len, reverse=True))) + r"|[()\[\]{},]")
    strings = {q: re.compile(rf"[^\\{q}]*(?:\\.[^\\{q}]*)*{q}" if escapes and len(q) == 1
                             else rf".*?{re.escape(q)}", re.S) for q in quotes}
    return marks, strings


BOOLEAN = "/true|false|True|False/"  # a boolean as JSON or Python writes it, in lark


def literal(text: str) -> str:
    """A lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Lark(Protocol):
    """What a format's grammar is written with (given by the caller, who knows the
    tokenizer and how JSON is constrained)."""

    def tag(self, text: str) -> str:
        """A markup tag: the special token it is, when it is one, else its text."""

    def json(self, schema: dict) -> str:
        """A value following a JSON schema."""


def json_grammar(write: Callable[[Lark, str, str], str]) -> Grammar:
    """Forcing for calls whose arguments are JSON: `write(lark, name, arguments)` is
    the lark of one call, given the rule its arguments follow."""
    def grammar(lark, functions):
        lines = []
        for i, function in enumerate(functions):
            lines.append(f"arguments{i}: {lark.json(function.get('parameters') or {'type': 'object'})}")
            lines.append(f"call{i}: {write(lark, function['name'], f'arguments{i}')}")
        return lines

    return grammar


def required_parameters(function: dict) -> list[tuple[str, dict]]:
    """A function's required parameters and their schemas, in the schema's order: what
    a forced call writes."""
    schema = function.get("parameters") or {}
    properties = schema.get("properties") or {}
    return [(key, properties[key] or {}) for key in properties if key in (schema.get("required") or ())]


def param_grammar(write: Callable[[Lark, str, str], str], parameter: Callable[[Lark, str, str], str],
                  closing: str = "") -> Grammar:
    """Forcing for calls written one parameter at a time: `write(lark, name, params)` is
    the lark of one call around its parameters, `parameter(lark, key, value)` that of
    one parameter, and `closing` the text after each value, where it could be taken for
    more of a string (Qwen3-Coder's line break before </parameter>): a string and its
    closing are then one lexeme, which ends where the closing first comes. The required
    parameters are written in the schema's order; a string is text without markup, a
    boolean as JSON or Python writes it (templates write either, the parsers read both),
    any other type JSON of its schema."""
    end = f" {literal(closing)}" if closing else ""

    def grammar(lark, functions):
        lines = []
        for i, function in enumerate(functions):
            parts = []
            for j, (key, spec) in enumerate(required_parameters(function)):
                kind, value = spec.get("type"), f"value{i}_{j}"
                if kind == "string":
                    lines.append(f"{value}{'[lazy]' if closing else ''}: /[^<]*/{end}")
                else:
                    lines.append(f"{value}: {BOOLEAN if kind == 'boolean' else lark.json(spec)}{end}")
                parts.append(parameter(lark, key, value))
            lines.append(f"call{i}: {write(lark, function['name'], ' '.join(parts) or literal(''))}")
        return lines

    return grammar
