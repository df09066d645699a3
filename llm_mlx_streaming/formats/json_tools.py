"""Qwen3's calls (and the templates written like them): one JSON object
{"name": ..., "arguments": {...}} in each <tool_call> block (mlx-lm's json_tools)."""

from .reading import json_calls
from .tool_format import ToolFormat


def grammar(lark, functions):
    """Each call is the object {"name": its name, "arguments": its parameters' schema}."""
    return [f'call{i}: "\\n" ' + lark.json({
        "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
    }) + ' "\\n"' for i, f in enumerate(functions)]


FORMAT = ToolFormat(
    name="json_tools",
    parser="mlx_lm.tool_parsers.json_tools",
    reading=json_calls(r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)',
                       tail=r"\s*\}\s*", held=r"\}?\s*"),
    grammar=grammar,
)
