"""Forcing a format's calls: the lark rules of each call a grammar may write (one per
function, `call0`, `call1`, ...), which prompt/tools.py joins into the grammar of a
forced reply. Two shapes cover the families: the arguments are JSON of the function's
schema (`json_grammar`), or its parameters are written one at a time (`param_grammar`:
in markup, or in a literal syntax of the format's own with a separator between them).
"""

from __future__ import annotations

import json
from typing import Callable, Optional, Protocol

BOOLEAN = "/true|false|True|False/"  # a boolean as JSON or Python writes it, in lark
STRING = "/[^<]*/"  # a string parameter's value: text without markup, in lark

# (the grammar's writer, functions [{"name", "parameters"}]) -> lark rules call0, call1, ... (one call each)
Grammar = Callable[["Lark", list[dict]], list[str]]


def literal(text: str) -> str:
    """A lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Lark(Protocol):
    """What a format's grammar is written with (given by the caller, who knows the
    tokenizer and how JSON is constrained)."""

    def tag(self, text: str) -> str:
        """A markup tag: the special token it is, when it is one, else its text."""

    def text(self, text: str) -> str:
        """Text that may hold special tokens: each one as its token, the rest as text."""

    def json(self, schema: dict) -> str:
        """A value following a JSON schema."""


def json_grammar(call_rule: Callable[[Lark, str, str], str]) -> Grammar:
    """Forcing for calls whose arguments are JSON: `call_rule(lark, name, arguments)`
    is the lark of one call, given the rule its arguments follow."""
    def grammar(lark, functions):
        lines = []
        for i, function in enumerate(functions):
            lines.append(f"arguments{i}: {lark.json(function.get('parameters') or {'type': 'object'})}")
            lines.append(f"call{i}: {call_rule(lark, function['name'], f'arguments{i}')}")
        return lines

    return grammar


def required_parameters(function: dict) -> list[tuple[str, dict]]:
    """A function's required parameters and their schemas, in the schema's order: what
    a forced call writes."""
    schema = function.get("parameters") or {}
    properties = schema.get("properties") or {}
    return [(key, properties[key] or {}) for key in properties if key in (schema.get("required") or ())]


def param_grammar(call_rule: Callable[[Lark, str, str], str], parameter_rule: Callable[[Lark, str, str, dict], str],
                  *, separator: str = "", after_value: str = "", string: str = STRING,
                  boolean: Optional[str] = BOOLEAN, by_name: bool = False) -> Grammar:
    """Forcing for calls written one parameter at a time: `call_rule(lark, name, params)`
    is the lark of one call around its parameters, `parameter_rule(lark, key, value,
    schema)` that of one parameter, `separator` the text between two parameters (Gemma's
    and Python's commas), and `after_value` the text after each value, where it could be
    taken for more of a string (Qwen3-Coder's line break before </parameter>): a string
    and its `after_value` are then one lexeme, which ends where that text first comes.
    The required parameters are written in the schema's order (`by_name`: sorted by
    name, as Gemma's template writes them); a string is `string` (text without markup),
    a boolean `boolean` (as JSON or Python writes it: templates write either, most
    parsers read both; None: JSON), any other type JSON of its schema."""
    end = f" {literal(after_value)}" if after_value else ""
    between = f" {literal(separator)} " if separator else " "

    def grammar(lark, functions):
        lines = []
        for i, function in enumerate(functions):
            parameters = required_parameters(function)
            parts = []
            for j, (key, spec) in enumerate(sorted(parameters, key=lambda p: p[0]) if by_name else parameters):
                kind, value = spec.get("type"), f"value{i}_{j}"
                if kind == "string":
                    lines.append(f"{value}{'[lazy]' if after_value else ''}: {string}{end}")
                else:
                    lines.append(f"{value}: {boolean if kind == 'boolean' and boolean else lark.json(spec)}{end}")
                parts.append(parameter_rule(lark, key, value, spec))
            lines.append(f"call{i}: {call_rule(lark, function['name'], between.join(parts) or literal(''))}")
        return lines

    return grammar
