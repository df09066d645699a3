"""Gemma 4's calls: <|tool_call>call:NAME{key:VALUE,...}<tool_call|>, a block per
call, the arguments in Gemma's own literal syntax (bare keys, strings between <|"|>
delimiters, numbers, true/false, lists and objects; mlx-lm's gemma4). The template
writes the parameters sorted by name."""

from .forcing import literal, param_grammar
from .reading import literal_calls
from .tool_format import ToolFormat

PARSER = "mlx_lm.tool_parsers.gemma4"
QUOTE = '<|"|>'


def parameter(lark, key: str, value: str, spec: dict) -> str:
    """key:VALUE, a string between the delimiters (text without markup), any other type
    as JSON (which the parser reads as it is)."""
    if spec.get("type") == "string":
        return f'{literal(key + ":")} {lark.tag(QUOTE)} {value} {lark.tag(QUOTE)}'
    return f'{literal(key + ":")} {value}'


FORMAT = ToolFormat(
    name="gemma4",
    parser=PARSER,
    reading=literal_calls(r"call:(?P<name>[\w-]+)\{", (QUOTE,), False,
                          lambda name, arguments: f"call:{name}{{{arguments}}}"),
    grammar=param_grammar(lambda lark, name, params: f'{literal("call:" + name + "{")} {params} "}}"', parameter,
                          separator=",", boolean=None, by_name=True),
)
