"""LFM2's and LFM2.5's calls: a Python list of calls, [NAME(key=VALUE, ...), ...], in
a <|tool_call_start|> block (mlx-lm's pythonic, which reads the values as Python
literals, JSON's true/false/null too)."""

from .base import BOOLEAN, ToolFormat, literal, literal_calls, required_parameters

PARSER = "mlx_lm.tool_parsers.pythonic"
STRING = r"""/"[^"\\<\n]*"/ | /'[^'\\<\n]*'/"""


def grammar(lark, functions):
    """Each call is a one-call list, with its required parameters in the schema's order:
    a string quoted either way (text without markup), a boolean as JSON or Python writes
    it, any other type as JSON. Forced parallel calls are a block each (the parser reads
    each), as the grammar's composer joins calls in one block with line breaks, not a
    list's commas."""
    lines = []
    for i, function in enumerate(functions):
        parts = []
        for j, (key, spec) in enumerate(required_parameters(function)):
            value = f"value{i}_{j}"
            kind = spec.get("type")
            lines.append(f"{value}: " + (STRING if kind == "string" else BOOLEAN if kind == "boolean"
                                         else lark.json(spec)))
            parts.append(f"{literal(key + '=')} {value}")
        params = ' ", " '.join(parts)
        lines.append(f'call{i}: {literal("[" + function["name"] + "(")} {params} ")]"')
    return lines


FORMAT = ToolFormat(
    name="pythonic",
    parser=PARSER,
    reading=literal_calls(r"(?P<name>[A-Za-z_][\w.]*)\(", ("'", '"'), True,
                          lambda name, arguments: f"[{name}({arguments})]")(PARSER),
    grammar=grammar,
)
