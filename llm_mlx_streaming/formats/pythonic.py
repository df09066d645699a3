"""LFM2's and LFM2.5's calls: a Python list of calls, [NAME(key=VALUE, ...), ...], in
a <|tool_call_start|> block (mlx-lm's pythonic, which reads the values as Python
literals, JSON's true/false/null too).

Forced, each call is a one-call list, with its required parameters in the schema's
order: a string quoted either way (text without markup), a boolean as JSON or Python
writes it, any other type as JSON. Forced parallel calls are a block each (the parser
reads each), as the grammar's composer joins calls in one block with line breaks, not a
list's commas."""

from .forcing import literal, param_grammar
from .reading import literal_calls
from .tool_format import ToolFormat

PARSER = "mlx_lm.tool_parsers.pythonic"
STRING = r"""/"[^"\\<\n]*"/ | /'[^'\\<\n]*'/"""

FORMAT = ToolFormat(
    name="pythonic",
    parser=PARSER,
    reading=literal_calls(r"(?P<name>[A-Za-z_][\w.]*)\(", ("'", '"'), True,
                          lambda name, arguments: f"[{name}({arguments})]"),
    grammar=param_grammar(lambda lark, name, params: f'{literal("[" + name + "(")} {params} ")]"',
                          lambda lark, key, value, spec: f"{literal(key + '=')} {value}",
                          separator=", ", string=STRING),
)
