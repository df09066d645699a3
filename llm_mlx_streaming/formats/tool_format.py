"""What a tool-call format is: its markup and parser (mlx-lm's `tool_parsers/` shape:
`tool_call_start`, `tool_call_end`, `parse_tool_call(text, tools)`), how its calls are
read while they are still being written (reading.py), how one is forced (forcing.py),
and how it is recognised when mlx-lm's own inference misses it.

The names mean one thing each across formats/: `tools` are the request's function
specs as the chat template and mlx-lm's parsers take them ({"type": "function",
"function": {...}}), `functions` the functions inside them ({"name", "parameters"}: what
a grammar forces); `tool_call_start` and `tool_call_end` the markup around a block of
calls, as mlx-lm names it (`ReasoningMarks.start` and `.end` are a reasoning block's).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .forcing import Grammar
from .reading import Reading


@dataclass(frozen=True)
class ReasoningMarks:
    """Where a reply's reasoning is, as text: the block opens at `start` and ends at
    `end`, and `answer` is what the format writes after the end to begin the answer
    (harmony's final-channel header; "" where the answer simply follows). A thinking
    budget closes the block by forcing `end` + `answer`; where the model has tools, `end`
    and then a grammar of `answer` or a call (reply/build.py)."""

    start: str
    end: str
    answer: str = ""


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call format. `parser` names a module with mlx-lm's parser
    interface (`tool_call_start`, `tool_call_end`, `parse_tool_call`), or is an object
    with it (a format learned from a template, learned.py). `origin` says where the
    format comes from: a module of ours ("ours"), mlx-lm's parser as it is ("mlx-lm"),
    or the checkpoint's template ("learned"). `reading` and `grammar` are None where
    calls are given whole when their block closes and cannot be forced. `detect(template, vocab)` recognises the format
    where mlx-lm's inference does not. `response_format` is mlx-lm's text-state-machine
    spec for formats that write in channels (harmony). `blocks`: each call is its own
    block (tool_call_start ... tool_call_end), else all the turn's calls share one.
    `write`: calls in the markup, tool_call_start and tool_call_end included, for a
    template that renders no `tool_calls`. `call_id`: where the model names its calls
    itself (Kimi's functions.NAME:i), the id its template expects back for the
    conversation's i-th call. `declare`: the tools described as the model's publishers
    have the system prompt describe them, for a template that renders no `tools`.
    `reasoning`: where a format that writes in channels reasons (think tags are
    mlx-lm's to find)."""

    name: str
    parser: Any
    reading: Optional[Reading] = None
    grammar: Optional[Grammar] = None
    detect: Optional[Callable[[str, dict], bool]] = None
    response_format: Optional[dict] = None
    blocks: bool = True
    lead: str = ""  # what the reply writes before a call's tool_call_start (harmony's channel header)
    write: Optional[Callable[[list[tuple[str, str, dict]]], str]] = None  # calls (id, name, arguments) as written
    call_id: Optional[Callable[[str, int], str]] = None  # the id the model gives the conversation's i-th call
    declare: Optional[Callable[[list[dict]], str]] = None  # tools -> their description
    reasoning: Optional[ReasoningMarks] = None
    origin: str = "ours"

    @property
    def module(self):
        return importlib.import_module(self.parser) if isinstance(self.parser, str) else self.parser

    @property
    def tool_call_start(self) -> str:
        return self.module.tool_call_start

    @property
    def tool_call_end(self) -> str:
        return self.module.tool_call_end

    def read(self, text: str, closed: bool, tools: Optional[list]) -> list[tuple[str, str]]:
        """The calls in a block's markup so far (`closed`: the block has ended), each
        (name, arguments' JSON text so far), read by `reading` with this format's parser."""
        return self.reading(self.module, text, closed, tools)

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
