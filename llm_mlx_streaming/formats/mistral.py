"""Mistral's calls: [TOOL_CALLS]NAME[ARGS]{json}, repeated for parallel calls, with no
end tag (the turn's end closes them; mlx-lm's mistral, which also reads the older
[TOOL_CALLS] [{"name": ..., "arguments": ...}] list)."""

from .base import ToolFormat, json_calls, json_grammar, literal

FORMAT = ToolFormat(
    name="mistral",
    parser="mlx_lm.tool_parsers.mistral",
    reading=json_calls(r"(?:\[TOOL_CALLS\])?\s*(?P<name>[\w-]+)\s*\[ARGS\]\s*", tail=r"\s*(?:\[TOOL_CALLS\])?\s*",
                       held=r"\s*(?:\[TOOL_CALLS\]|\[TOOL_CALLS?|\[TOOL_?|\[TOO?|\[T?)?\s*"),
    grammar=json_grammar(lambda lark, name, arguments: f'{literal(name)} {lark.tag("[ARGS]")} {arguments}'),
    blocks=False,
)
