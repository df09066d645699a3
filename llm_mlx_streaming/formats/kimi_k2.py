"""Kimi-K2's calls: a <|tool_calls_section_begin|> section of
<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json}<|tool_call_end|>
(mlx-lm's kimi_k2). mlx-lm infers it from the Thinking model's template; the Instruct
model's template (as llama.cpp ships it) never spells a call, so it is recognised by
its vocabulary too."""

from .base import ToolFormat, json_calls, json_grammar, literal

SECTION = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>")

FORMAT = ToolFormat(
    name="kimi_k2",
    parser="mlx_lm.tool_parsers.kimi_k2",
    reading=json_calls(r"<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[\w.\-]+?):\d+\s*"
                       r"<\|tool_call_argument_begin\|>\s*", call_end="<|tool_call_end|>"),
    grammar=json_grammar(lambda lark, name, arguments: (
        f'{lark.tag("<|tool_call_begin|>")} {literal(f"functions.{name}:")} /[0-9]+/ '
        f'{lark.tag("<|tool_call_argument_begin|>")} {arguments} {lark.tag("<|tool_call_end|>")}')),
    detect=lambda template, vocab: all(tag in vocab for tag in SECTION),
    blocks=False,
)
