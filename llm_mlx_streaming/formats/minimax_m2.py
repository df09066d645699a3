"""MiniMax-M2's calls: one <minimax:tool_call> block holding an
<invoke name="NAME"> element per call, with a <parameter name="KEY">VALUE</parameter>
element per parameter (mlx-lm's minimax_m2)."""

from .forcing import literal, param_grammar
from .reading import param_calls
from .tool_format import ToolFormat

PARSER = "mlx_lm.tool_parsers.minimax_m2"


def invoke(lark, name: str, params: str) -> str:
    head = literal('<invoke name="' + name + '">')
    return f'"\\n"? {head} "\\n" {params} "</invoke>" "\\n"?'


def parameter(lark, key: str, value: str, spec: dict) -> str:
    head = literal('<parameter name="' + key + '">')
    return f'{head} {value} "</parameter>\\n"'


FORMAT = ToolFormat(
    name="minimax_m2",
    parser=PARSER,
    reading=param_calls(r"<invoke name=[\"']?(?P<name>[^\"'>]+)[\"']?>", r"</parameter>", "\n</invoke>"),
    grammar=param_grammar(invoke, parameter),
    blocks=False,
)
