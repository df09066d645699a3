"""gpt-oss's harmony format. After the generation prompt (<|start|>assistant) the model
writes messages, each behind a header naming its channel:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The recipient may instead come in the role header (<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>{json}, as gpt-oss's template writes past calls),
and a preamble to the user is a commentary message without one. <|call|> and <|return|>
end the turn (gpt-oss's generation_config.json lists them with the end-of-turn tokens),
so a turn holds one call at most.

`RESPONSE_FORMAT` splits the reply with mlx-lm's text state machine: the analysis
channel is reasoning, a message to `functions.` a call (its block is what follows
"to=functions.": the name, the rest of the header and the arguments' JSON), any other
message answer text, and the headers markup, dropped.

Why a parser of text and not OpenAI's openai-harmony package: it parses token ids of
its own encoding (o200k_harmony), not text, and builds that encoding from a vocabulary
file it downloads on first use (o200k_base.tiktoken, which a checkpoint does not ship).
Checked with openai-harmony 0.0.8 in a throwaway venv: without network,
`load_harmony_encoding("HarmonyGptOss")` fails ("error downloading or loading vocab
file"), and its StreamableParser takes token ids, so neither the text mlx-lm's
detokenizer streams nor a test tokenizer's ids can be given to it. mlx-lm has no
harmony parser: the parsing part of this module is one, in its tool_parsers/ shape.
"""

import json
import re
from typing import Any

from .forcing import json_grammar, literal
from .reading import json_calls
from .tool_format import ReasoningMarks, ToolFormat

tool_call_start = "to=functions."
tool_call_end = ""  # the call ends the turn (<|call|> is an end-of-turn token)
# The analysis message, and the final channel's header that follows it
REASONING = ReasoningMarks("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant<|channel|>final<|message|>")

RESPONSE_FORMAT = {
    "initial_state": "header",
    "transitions": {
        "header": [
            (REASONING.start, "reasoning"),
            (tool_call_start, "tool"),
            ("<|message|>", "normal"),  # final, a preamble in commentary
        ],
        "reasoning": [(REASONING.end, "header")],
        "normal": [("<|end|>", "header")],
        "tool": [("<|call|>", "header")],  # where <|call|> is not an end-of-turn token
    },
}

_call = re.compile(r"\s*(?P<name>[^\s<]+)(?:(?!<\|message\|>).)*<\|message\|>(?P<arguments>.*)", re.S)


def parse_tool_call(text: str, tools: Any = None):
    match = _call.match(text)
    if match is None:
        raise ValueError("No tool call found.")
    return dict(name=match.group("name"), arguments=json.loads(match.group("arguments")))


FORMAT = ToolFormat(
    name="harmony",
    parser=__name__,
    reading=json_calls(r"\s*(?P<name>[^\s<]+)(?:(?!<\|message\|>).)*<\|message\|>\s*"),
    grammar=json_grammar(lambda lark, name, arguments: (
        f'{literal(name)} " " {lark.tag("<|constrain|>")} "json" {lark.tag("<|message|>")} {arguments}')),
    detect=lambda template, vocab: all(tag in template or tag in vocab
                                       for tag in ("<|channel|>", "<|message|>", "<|constrain|>")),
    response_format=RESPONSE_FORMAT,
    reasoning=REASONING,
    lead="<|channel|>commentary ",
)
