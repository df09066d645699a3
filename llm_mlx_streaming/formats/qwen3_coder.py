"""Qwen3-Coder's calls (Step-3.7-Flash writes the same): XML in each <tool_call> block,
<function=NAME> with one <parameter=KEY> element a parameter (mlx-lm's qwen3_coder)."""

from .forcing import literal, param_grammar
from .reading import param_calls
from .tool_format import ToolFormat

PARSER = "mlx_lm.tool_parsers.qwen3_coder"

FORMAT = ToolFormat(
    name="qwen3_coder",
    parser=PARSER,
    reading=param_calls(r"<function=(?P<name>[^\s<>]+)>", r"</parameter>", "\n</function>"),
    grammar=param_grammar(
        lambda lark, name, params: f'"\\n" {literal(f"<function={name}>")} "\\n" {params} "</function>\\n"',
        lambda lark, key, value, spec: f'{literal(f"<parameter={key}>")} "\\n" {value}',
        after_value="\n</parameter>\n"),
)
