"""DeepSeek-V3.2's calls, in its DSML markup: one block holds them all, an invoke a
call and one element a parameter,

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

where string="true" means the value is a string as written and "false" that it is JSON.
mlx-lm renders the model's prompts with its own Python renderer (chat_templates/
deepseek_v32.py, named by the tokenizer config's `chat_template_type`) but has no
parser for these calls: the parsing part of this module is one, in mlx-lm's
tool_parsers/ shape. The format is recognised by the DSML token, which V3.2's
vocabulary has (with the checkpoint's renderer there is no template text to read);
the vocabulary also has V3.1's tool-call tokens, so it is asked before deepseek_v31
(registry.PRECEDENCE).
"""

import json
import re
from typing import Any

from .forcing import literal, param_grammar
from .reading import param_calls
from .tool_format import ToolFormat

DSML = "｜DSML｜"

tool_call_start = f"<{DSML}function_calls>"
tool_call_end = f"</{DSML}function_calls>"

_invoke = re.compile(rf'<{DSML}invoke\s+name="(?P<name>[^"]*)"\s*>(?P<body>.*?)(?:</{DSML}invoke>|\Z)', re.S)
_parameter = re.compile(rf'<{DSML}parameter\s+name="(?P<key>[^"]*)"(?:\s+string="(?P<string>true|false)")?\s*>'
                        rf"(?P<value>.*?)</{DSML}parameter>", re.S)


def _declared_type(tools: Any, name: str, key: str) -> Any:
    """The type the function's schema gives a parameter (None if it is not known)."""
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if function.get("name") == name:
            return (((function.get("parameters") or {}).get("properties") or {}).get(key) or {}).get("type")
    return None


def _value(text: str, string: bool) -> Any:
    if string:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_tool_call(text: str, tools: Any = None):
    calls = []
    for invoke in _invoke.finditer(text):
        name, arguments = invoke.group("name"), {}
        for parameter in _parameter.finditer(invoke.group("body")):
            key, string = parameter.group("key"), parameter.group("string")
            is_string = string == "true" if string else _declared_type(tools, name, key) == "string"
            arguments[key] = _value(parameter.group("value"), is_string)
        calls.append(dict(name=name, arguments=arguments))
    if not calls:
        raise ValueError("No tool call found.")
    return calls


def parameter(lark, key: str, value: str, spec: dict) -> str:
    """A parameter element: a string is text without markup (string="true"), any other
    type JSON of its schema (string="false")."""
    head = f'<{DSML}parameter name="{key}" string="{"true" if spec.get("type") == "string" else "false"}">'
    return f'{literal(head)} {value} {literal(f"</{DSML}parameter>")}'


def invoke(lark, name: str, params: str) -> str:
    """A call's invoke, its parameters a line each, laid out as the template writes it."""
    head, end = literal(f'<{DSML}invoke name="{name}">'), literal(f"</{DSML}invoke>")
    return f'"\\n" {head} "\\n" {params} "\\n" {end} "\\n"?'


FORMAT = ToolFormat(
    name="deepseek_v32",
    parser=__name__,
    reading=param_calls(rf'<{DSML}invoke\s+name="(?P<name>[^"]*)"\s*>', rf"</{DSML}parameter>",
                        f"\n</{DSML}invoke>"),
    grammar=param_grammar(invoke, parameter, separator="\n", boolean=None),
    detect=lambda template, vocab: DSML in template or DSML in vocab,
    blocks=False,
)
