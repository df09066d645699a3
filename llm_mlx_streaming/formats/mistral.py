"""Mistral's calls: [TOOL_CALLS]NAME[ARGS]{json}, repeated for parallel calls, or, as
the older templates (Small 3.1) write them, [TOOL_CALLS] [{"name": ..., "arguments":
{...}, "id": ...}, ...]; there is no end tag (the turn's end closes them; mlx-lm's
mistral reads both)."""

from .forcing import json_grammar, literal
from .reading import json_objects
from .tool_format import ToolFormat

# A call's head, in either form, up to its arguments' JSON object
HEAD = (r'(?:\[TOOL_CALLS\])?\s*(?:\{\s*"name"\s*:\s*")?(?P<name>[\w-]+)'
        r'(?:"\s*,\s*"arguments"\s*:|\s*\[ARGS\])\s*')


FORMAT = ToolFormat(
    name="mistral",
    parser="mlx_lm.tool_parsers.mistral",
    reading=json_objects(HEAD),
    grammar=json_grammar(lambda lark, name, arguments: f'{literal(name)} {lark.tag("[ARGS]")} {arguments}'),
    blocks=True,  # a forced call is written as its own [TOOL_CALLS]NAME[ARGS]{...}, as Mistral writes each
)
