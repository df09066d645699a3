"""Reading a format's calls while they are still being written.

Calls are streamed as OpenAI's clients expect them, a name and then the arguments as
JSON text in pieces whose concatenation is the whole arguments' JSON. Three shapes cover
the families: the arguments are JSON in the markup (`json_calls`, or `json_objects`
where the object's own brackets say where it ends: streamed as written),
they are written one parameter at a time in markup (`param_calls`), or in a literal
syntax of the format's own (`literal_calls`: Python's keywords, Gemma's objects); in
the last two each parameter is streamed once complete, read by the format's own parser
(`so_far`), so the values are typed as it types them. Every factory returns a
`Reading`, which the format calls with its parser module (`ToolFormat.read`).
"""

from __future__ import annotations

import functools
import json
import re
from types import ModuleType
from typing import Callable, Optional

from ..stops import partial_suffix

# (the format's parser module, markup so far, whether the block is closed, the tools)
#   -> [(name, arguments' JSON text so far)]
Reading = Callable[[ModuleType, str, bool, Optional[list]], list[tuple[str, str]]]


def json_calls(head: str, call_end: str = "", tail: str = r"\s*", held: str = r"\s*") -> Reading:
    """Calls written as a head naming the function (`head`, a regex with a group
    `name`) followed by the arguments' JSON, which ends at `call_end`, the next head or
    the end of the block; `tail` is what follows the JSON there (stripped), `held` what
    may still turn out to be that tail while the block is open (held back). The JSON is
    streamed as written: the parser is not asked."""
    heads = re.compile(head, re.S)
    tail_re, held_re = re.compile(f"(?:{tail})\\Z", re.S), re.compile(f"(?:{held})\\Z", re.S)

    def reading(parser: ModuleType, text: str, closed: bool, tools=None) -> list[tuple[str, str]]:
        out = []
        for match, region, ended in _calls(heads, text, closed):
            region = region[match.end() - match.start():]
            if call_end and call_end in region:
                region, ended = region[: region.index(call_end)], True
            elif not ended and call_end:
                region = region[: len(region) - partial_suffix(region, call_end)]
            cut = (tail_re.search(region) if ended else None) or held_re.search(region)
            region = region[: cut.start()]
            out.append((match.group("name"), region))
        return out

    return reading


def json_objects(head: str) -> Reading:
    """Calls written as a head naming the function (`head`, a regex with a group `name`,
    ending where the arguments begin) followed by the arguments as one JSON object,
    streamed as written up to where its brackets close (what follows, an id or the next
    call, is not read as it). A call's name is given once its arguments are due."""
    heads = re.compile(head, re.S)

    def reading(parser: ModuleType, text: str, closed: bool, tools=None) -> list[tuple[str, str]]:
        out, at = [], 0
        while match := heads.search(text, at):
            begin = match.end()
            if not text.startswith("{", begin):
                if begin == len(text):
                    out.append((match.group("name"), ""))
                break
            _, end = bracketed(text, begin + 1, ('"',), True)
            out.append((match.group("name"), text[begin:] if end is None else text[begin:end + 1]))
            if end is None:
                break
            at = end + 1
        return out

    return reading


def param_calls(head: str, closed_parameter: str, cut_end: str) -> Reading:
    """For a format whose calls write one parameter at a time: a call starts at `head`
    (a regex with a group `name`), a parameter is complete at the end of a match of
    `closed_parameter`, and `cut_end` completes a call cut after a parameter so the
    format's parser reads it."""
    heads, params = re.compile(head, re.S), re.compile(closed_parameter, re.S)

    def reading(parser: ModuleType, text: str, closed: bool, tools=None) -> list[tuple[str, str]]:
        out = []
        for match, region, ended in _calls(heads, text, closed):
            if not ended:
                last = None
                for last in params.finditer(region):
                    pass
                region = (region[: last.end()] if last else region[: match.end() - match.start()]) + cut_end
            arguments = so_far(parser, region, tools, ended)
            if arguments is None:
                break
            out.append((match.group("name"), arguments))
        return out

    return reading


def literal_calls(head: str, quotes: tuple[str, ...], escapes: bool, call: Callable[[str, str], str]) -> Reading:
    """For a format that writes a call as a name and its arguments in a literal syntax
    of its own (Python's keywords, Gemma's objects): a call starts at `head` (a regex with
    a group `name`, ending at the bracket that opens the arguments); its arguments run to
    the matching bracket, parameters apart at the commas outside strings (delimited by
    any of `quotes`, a backslash escaping where `escapes`) and brackets. Each parameter
    is streamed once the next begins, read by the format's parser from `call(name,
    the parameters so far)`."""
    heads = re.compile(head, re.S)

    def reading(parser: ModuleType, text: str, closed: bool, tools=None) -> list[tuple[str, str]]:
        out, at = [], 0
        while match := heads.search(text, at):
            commas, end = bracketed(text, match.end(), quotes, escapes)
            done = text[match.end():end if end is not None else (commas[-1] if commas else match.end())]
            arguments = so_far(parser, call(match.group("name"), done), tools, end is not None)
            if arguments is None:
                break
            out.append((match.group("name"), arguments))
            if end is None:
                break
            at = end + 1
        return out

    return reading


def _calls(heads: re.Pattern, text: str, closed: bool):
    """Each call in the markup: its head's match, its text (from the head up to the next
    head or the end), and whether it has ended (the block closed, or another call follows)."""
    found = list(heads.finditer(text))
    for i, match in enumerate(found):
        stop = found[i + 1].start() if i + 1 < len(found) else len(text)
        yield match, text[match.start():stop], closed or i + 1 < len(found)


def so_far(parser: ModuleType, text: str, tools, ended: bool) -> Optional[str]:
    """The arguments' JSON text of the call `text` holds, as the format's parser reads
    them: whole where the call has `ended`, else without the closing brace (more may
    come; {} while the parser reads none yet). None for an ended call it reads no
    arguments of: the reading stops there."""
    try:
        parsed = parser.parse_tool_call(text, tools)
    except Exception:  # not yet a call its parser reads
        parsed = None
    found = parsed[0] if isinstance(parsed, list) and parsed else parsed
    arguments = found.get("arguments") if isinstance(found, dict) else None
    if not isinstance(arguments, dict):
        if ended:
            return None
        arguments = {}
    text_so_far = json.dumps(arguments, ensure_ascii=False)
    return text_so_far if ended else text_so_far[:-1]


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
