"""DeepSeek-V3.1's calls: one <｜tool▁calls▁begin｜> section holds them all, each
<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>. DeepSeek-V3 (0324) and R1
wrote <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME, then the JSON in a ```json fence;
the parser reads both. mlx-lm has no parser for them: the parsing part of this module
is one, in mlx-lm's tool_parsers/ shape. The format is recognised by its tags, in the
template or the vocabulary. DeepSeek-V3.1 thinks in <think> tags, which mlx-lm's
thinking inference finds in its vocabulary. Its template renders no tools: the model
card has them described after the system prompt (`declare`).
"""

import json
import re
from typing import Any

from .forcing import json_grammar, literal
from .reading import json_calls
from .tool_format import ToolFormat

tool_call_start = "<｜tool▁calls▁begin｜>"
tool_call_end = "<｜tool▁calls▁end｜>"

CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

# V3's "function<｜tool▁sep｜>NAME ```json" or V3.1's "NAME<｜tool▁sep｜>", up to the arguments' "{"
_head = re.compile(rf"{CALL_BEGIN}\s*(?:function\s*{SEP}\s*)?(?P<name>[^\s<`{{]+)\s*"
                   rf"(?:{SEP}|```(?:json)?)\s*(?=\{{)")
_fence = re.compile(r"\s*(?:```)?\s*\Z")


def declare(tools: list[dict]) -> str:
    """The tools as DeepSeek-V3.1's model card ("ToolCall") describes them after the
    system prompt."""
    described = "".join(f"### {f['name']}\nDescription: {f.get('description') or ''}\n\n"
                        f"Parameters: {json.dumps(f.get('parameters') or {})}\n\n"
                        for f in (spec.get("function", spec) for spec in tools))
    return ("## Tools\nYou have access to the following tools:\n\n" + described
            + "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
            f"{tool_call_start}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}"
            f"{{{{additional_tool_calls}}}}{tool_call_end}\n\n"
            "Where:\n\n"
            "- `tool_call_name` must be an exact match to one of the available tools\n"
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
            "- For multiple tool calls, chain them directly without separators or spaces\n")


def parse_tool_call(text: str, tools: Any = None):
    heads = list(_head.finditer(text))
    if not heads:
        raise ValueError("No tool call found.")
    calls = []
    for i, head in enumerate(heads):
        stop = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = text[head.end():stop]
        if CALL_END in body:
            body = body[: body.index(CALL_END)]
        arguments = json.loads(_fence.sub("", body))
        calls.append(dict(name=head.group("name"), arguments=arguments))
    return calls


FORMAT = ToolFormat(
    name="deepseek_v31",
    parser=__name__,
    reading=json_calls(_head.pattern, call_end=CALL_END, tail=r"\s*(?:```)?\s*", held=r"\s*`{0,3}\s*"),
    grammar=json_grammar(lambda lark, name, arguments: (
        f"{lark.tag(CALL_BEGIN)} {literal(name)} {lark.tag(SEP)} {arguments} {lark.tag(CALL_END)}")),
    # V3.2 keeps these tags in its vocabulary: deepseek_v32 is asked first (registry.PRECEDENCE)
    detect=lambda template, vocab: all(tag in template or tag in vocab for tag in (tool_call_start, SEP)),
    blocks=False,
    declare=declare,
)
