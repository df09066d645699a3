"""Kimi-K3's calls, in its XTML markup: one tools section holds them all, a call element
each (numbered from 1) and an argument element a parameter,

    <|open|>tools<|sep|>
    <|open|>call tool="NAME" index="1"<|sep|>
    <|open|>argument key="KEY" type="string"<|sep|>VALUE<|close|>argument<|sep|>
    <|close|>call<|sep|>
    <|close|>tools<|sep|>

where type is the value's JSON type (a string as written, any other type JSON; mlx-lm's
kimi_k3, which also reads the arguments as one `<|open|>json ...` block). mlx-lm infers
it from the XTML tokens of the vocabulary, and so is it recognised here. A reply opens
with the response block after its thinking (`<|open|>response<|sep|>`, which a forced
call's reply writes, `reasoning.answer`) and closes it before the calls (`lead`).
"""

from .forcing import literal, param_grammar
from .reading import param_calls
from .tool_format import ReasoningMarks, ToolFormat

PARSER = "mlx_lm.tool_parsers.kimi_k3"
XTML = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
         "object": "object", "array": "array", "null": "null"}


def parameter(lark, key: str, value: str, spec: dict) -> str:
    kind = TYPES.get(spec.get("type"), "object")
    return (f'{lark.tag("<|open|>")} {literal(f"argument key={chr(34)}{key}{chr(34)} type={chr(34)}{kind}{chr(34)}")} '
            f'{lark.tag("<|sep|>")} {value} {lark.tag("<|close|>")} "argument" {lark.tag("<|sep|>")}')


def call(lark, name: str, params: str) -> str:
    return (f'{lark.tag("<|open|>")} {literal(f"call tool={chr(34)}{name}{chr(34)} index={chr(34)}")} /[0-9]+/ '
            f'"\\"" {lark.tag("<|sep|>")} {params} {lark.tag("<|close|>")} "call" {lark.tag("<|sep|>")}')


FORMAT = ToolFormat(
    name="kimi_k3",
    parser=PARSER,
    reading=param_calls(r'<\|open\|>call\s+tool="(?P<name>[^"]*)"[^<]*<\|sep\|>', r"<\|close\|>argument<\|sep\|>",
                        "<|close|>call<|sep|>"),
    grammar=param_grammar(call, parameter, boolean=None),
    detect=lambda template, vocab: all(tag in vocab or tag in template for tag in XTML),
    blocks=False,
    lead="<|close|>response<|sep|>",
    reasoning=ReasoningMarks("<|open|>think<|sep|>", "<|close|>think<|sep|>", "<|open|>response<|sep|>"),
)
