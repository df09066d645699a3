"""Kimi-K2's calls: a <|tool_calls_section_begin|> section of
<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json}<|tool_call_end|>
(mlx-lm's kimi_k2). mlx-lm infers it from the Thinking model's template; the Instruct
model's template (as llama.cpp ships it) never spells a call, so it is recognised by
its vocabulary too."""

import json

from .forcing import json_grammar, literal
from .reading import json_calls
from .tool_format import ToolFormat


def write(calls: list[tuple[str, str, dict]]) -> str:
    """A turn's calls (id, name, arguments) as Kimi-K2 writes them."""
    return "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>"
        f"{json.dumps(arguments, ensure_ascii=False)}<|tool_call_end|>"
        for call_id, name, arguments in calls) + "<|tool_calls_section_end|>"


SECTION = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>")

FORMAT = ToolFormat(
    name="kimi_k2",
    parser="mlx_lm.tool_parsers.kimi_k2",
    reading=json_calls(r"<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[\w.\-]+?):\d+\s*"
                       r"<\|tool_call_argument_begin\|>\s*", call_end="<|tool_call_end|>"),
    grammar=json_grammar(lambda lark, name, arguments: (
        f'{lark.tag("<|tool_call_begin|>")} {literal(f"functions.{name}:")} /[0-9]+/ '
        f'{lark.tag("<|tool_call_argument_begin|>")} {arguments} {lark.tag("<|tool_call_end|>")}')),
    detect=lambda template, vocab: all(tag in vocab for tag in SECTION),
    blocks=False,
    write=write,
    call_id=lambda name, index: f"functions.{name}:{index}",
)
