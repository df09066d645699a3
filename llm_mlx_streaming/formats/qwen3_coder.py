"""Qwen3-Coder's calls (Step-3.7-Flash writes the same): XML in each <tool_call> block,
<function=NAME> with one <parameter=KEY> element a parameter (mlx-lm's qwen3_coder)."""

from .base import ToolFormat, literal, param_calls, param_grammar

PARSER = "mlx_lm.tool_parsers.qwen3_coder"

FORMAT = ToolFormat(
    name="qwen3_coder",
    parser=PARSER,
    reading=param_calls(r"<function=(?P<name>[^\s<>]+)>", r"</parameter>", "\n</function>")(PARSER),
    grammar=param_grammar(
        lambda lark, name, params: f'"\\n" {literal(f"<function={name}>")} "\\n" {params} "</function>\\n"',
        lambda lark, key, value: f'{literal(f"<parameter={key}>")} "\\n" {value}',
        closing="\n</parameter>\n"),
)
