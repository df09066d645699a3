"""Gemma 4's calls: <|tool_call>call:NAME{key:VALUE,...}<tool_call|>, a block per
call, the arguments in Gemma's own literal syntax (bare keys, strings between <|"|>
delimiters, numbers, true/false, lists and objects; mlx-lm's gemma4). The template
writes the parameters sorted by name."""

from .base import ToolFormat, literal, literal_calls, required_parameters

PARSER = "mlx_lm.tool_parsers.gemma4"
QUOTE = '<|"|>'


def grammar(lark, functions):
    """Each call writes its required parameters sorted by name, as the template does: a
    string between the delimiters (text without markup), any other type as JSON (which
    the parser reads as it is)."""
    lines = []
    for i, function in enumerate(functions):
        parts = []
        for j, (key, spec) in enumerate(sorted(required_parameters(function), key=lambda p: p[0])):
            value, quote = f"value{i}_{j}", lark.tag(QUOTE)
            string = spec.get("type") == "string"
            lines.append(f"{value}: " + (f"{quote} /[^<]*/ {quote}" if string else lark.json(spec)))
            parts.append(f'{literal(key + ":")} {value}')
        params = ' "," '.join(parts)
        lines.append(f'call{i}: {literal("call:" + function["name"] + "{")} {params} "}}"')
    return lines


FORMAT = ToolFormat(
    name="gemma4",
    parser=PARSER,
    reading=literal_calls(r"call:(?P<name>[\w-]+)\{", (QUOTE,), False,
                          lambda name, arguments: f"call:{name}{{{arguments}}}")(PARSER),
    grammar=grammar,
)
