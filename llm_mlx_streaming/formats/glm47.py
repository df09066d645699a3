"""GLM-4.5/4.6/4.7's calls: the function's name, then each parameter as
<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>, in each <tool_call> block
(mlx-lm's glm47; GLM-4.6's template puts a line break after the name and each
element, 4.5's and 4.7's do not)."""

from .forcing import literal, param_grammar
from .reading import param_calls
from .tool_format import ToolFormat

PARSER = "mlx_lm.tool_parsers.glm47"

FORMAT = ToolFormat(
    name="glm47",
    parser=PARSER,
    reading=param_calls(r"\A\s*(?P<name>[^\s<]+)(?=[\s<])", r"</arg_value>", ""),
    grammar=param_grammar(
        lambda lark, name, params: f'{literal(name)} "\\n"? {params}',
        lambda lark, key, value, spec: (f'{lark.tag("<arg_key>")} {literal(key)} {lark.tag("</arg_key>")} "\\n"? '
                                  f'{lark.tag("<arg_value>")} {value} {lark.tag("</arg_value>")} "\\n"?')),
)
