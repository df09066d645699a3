"""Mistral's calls: [TOOL_CALLS]NAME[ARGS]{json}, repeated for parallel calls, or, as
the older templates (Small 3.1) write them, [TOOL_CALLS] [{"name": ..., "arguments":
{...}, "id": ...}, ...]; there is no end tag (the turn's end closes them; mlx-lm's
mistral reads both)."""

import re

from .forcing import json_grammar, literal
from .reading import bracketed
from .tool_format import ToolFormat

HEAD = re.compile(r'(?:\[TOOL_CALLS\])?\s*(?:\{\s*"name"\s*:\s*")?(?P<name>[\w-]+)'
                  r'(?:"\s*,\s*"arguments"\s*:|\s*\[ARGS\])\s*')


def reading(parser, text: str, closed: bool, tools=None) -> list[tuple[str, str]]:
    """Each call's name once its arguments are due, then their JSON object as written,
    up to where it closes (what follows it, an id or the next call, is not read as it)."""
    out, at = [], 0
    while head := HEAD.search(text, at):
        begin = head.end()
        if not text.startswith("{", begin):
            if begin == len(text):
                out.append((head.group("name"), ""))
            break
        _, end = bracketed(text, begin + 1, ('"',), True)
        out.append((head.group("name"), text[begin:] if end is None else text[begin:end + 1]))
        if end is None:
            break
        at = end + 1
    return out


FORMAT = ToolFormat(
    name="mistral",
    parser="mlx_lm.tool_parsers.mistral",
    reading=reading,
    grammar=json_grammar(lambda lark, name, arguments: f'{literal(name)} {lark.tag("[ARGS]")} {arguments}'),
    blocks=True,  # a forced call is written as its own [TOOL_CALLS]NAME[ARGS]{...}, as Mistral writes each
)
