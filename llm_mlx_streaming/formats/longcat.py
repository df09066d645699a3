"""Meituan LongCat's calls: a <longcat_tool_call> block a call, holding either the
function's name and each parameter as <longcat_arg_key>KEY</longcat_arg_key>
<longcat_arg_value>VALUE</longcat_arg_value> (LongCat-Flash-Lite and the later
Thinking models), or one JSON object {"name": ..., "arguments": {...}} (LongCat-Flash-
Chat); mlx-lm's longcat reads both, typing a value by the function's schema. Recognised
by its tags, in the template or the vocabulary; forced in the key/value form."""

from .forcing import literal, param_grammar
from .reading import param_calls
from .tool_format import ToolFormat

PARSER = "mlx_lm.tool_parsers.longcat"


def parameter(lark, key: str, value: str, spec: dict) -> str:
    return (f'{lark.tag("<longcat_arg_key>")} {literal(key)} {lark.tag("</longcat_arg_key>")} "\\n"? '
            f'{lark.tag("<longcat_arg_value>")} {value} {lark.tag("</longcat_arg_value>")} "\\n"?')


def reading(parser, text: str, closed: bool, tools=None):
    """The key/value form streamed a parameter at a time; the JSON form given whole when
    its block closes (mlx-lm's parser reads it then)."""
    if text.lstrip().startswith("{"):
        return []
    return _KEY_VALUE(parser, text, closed, tools)


_KEY_VALUE = param_calls(r"\A\s*(?P<name>[^\s<]+)(?=[\s<])", r"</longcat_arg_value>", "")

FORMAT = ToolFormat(
    name="longcat",
    parser=PARSER,
    reading=reading,
    grammar=param_grammar(lambda lark, name, params: f'{literal(name)} "\\n"? {params}', parameter),
    detect=lambda template, vocab: "<longcat_tool_call>" in template or "<longcat_tool_call>" in vocab,
)
