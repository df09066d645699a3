"""Kimi-K2's tool calls (formats/kimi_k2.py): a `<|tool_calls_section_begin|>` section of
`<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json}<|tool_call_end|>`,
read with mlx-lm's kimi_k2 parser; recognised from the Instruct model's vocabulary, whose
template never writes a call."""

import json

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_a_forced_call_waits_for_the_thought,
                            assert_forces_one_call_or_the_named_one, every_way, family_tokenizer, forced, read_reply,
                            rendered_call)

from llm_mlx_streaming.formats.kimi_k2 import FORMAT

TOOLS = [WEATHER, TYPED]


def call(name: str, index: int, arguments: dict) -> str:
    return (f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{json.dumps(arguments)}"
            "<|tool_call_end|>")


def section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


PARIS, ROME = call("get_weather", 0, {"city": "Paris"}), call("get_weather", 1, {"city": "Rome"})
TYPED_CALL = call("book", 0, TYPED_ARGUMENTS)


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("kimi_k2_thinking")


def test_mlx_lm_infers_kimi_k2_from_the_thinking_template_and_we_from_the_instruct_vocabulary(tokenizer):
    assert tokenizer.init_kwargs["tool_parser_type"] == "kimi_k2"
    assert tokenizer.tool_format is FORMAT
    instruct = family_tokenizer("kimi_k2")
    assert "tool_parser_type" not in instruct.init_kwargs and instruct.tool_format is FORMAT
    assert instruct.has_tool_calling and instruct.tool_call_start == "<|tool_calls_section_begin|>"


def test_the_parser_reads_one_call_two_calls_and_arguments_of_every_json_type():
    inner = section(TYPED_CALL, ROME).removeprefix("<|tool_calls_section_begin|>").removesuffix(
        "<|tool_calls_section_end|>")
    assert FORMAT.parse(inner, TOOLS) == [{"name": "book", "arguments": TYPED_ARGUMENTS},
                                          {"name": "get_weather", "arguments": {"city": "Rome"}}]


def test_the_template_writes_calls_as_the_parser_reads_them(tokenizer):
    calls = [{"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Rome"}}]
    written = rendered_call(tokenizer, calls, TOOLS, ids=["functions.book:0", "functions.get_weather:1"])
    assert written == section(TYPED_CALL, ROME)
    assert read_reply(tokenizer, [written], TOOLS).found() == calls


def test_calls_after_reasoning_stream_their_names_then_their_arguments_however_the_text_is_cut(tokenizer):
    text = "<think>Book, then weather.</think>" + section(TYPED_CALL, ROME)
    for pieces, reply in every_way(tokenizer, text, TOOLS):
        assert reply.found() == [{"name": "book", "arguments": TYPED_ARGUMENTS},
                                 {"name": "get_weather", "arguments": {"city": "Rome"}}], pieces
        assert reply.arguments() == [TYPED_ARGUMENTS, {"city": "Rome"}], pieces
        assert reply.text("reasoning") == "Book, then weather." and reply.text() == ""
    # One character at a time: each name once its arguments begin, and they as they come.
    first, second = reply.when("name")
    assert first < text.index('"title"') and second < text.index('"city"')
    assert len(set(reply.when("arguments"))) > len(json.dumps(TYPED_ARGUMENTS)) / 2


def test_the_forced_grammar_takes_the_native_calls_and_nothing_else(tokenizer):
    grammar = forced(tokenizer, TOOLS)
    for text in (section(PARIS), section(TYPED_CALL), section(PARIS, ROME)):
        assert accepts(tokenizer, grammar, text), text
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert not accepts(tokenizer, grammar, section(call("get_time", 0, {"city": "Paris"})))
    assert not accepts(tokenizer, grammar, section(PARIS.replace("<|tool_call_argument_begin|>", "")))
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, section(PARIS), section(PARIS, ROME), section(TYPED_CALL))


def test_a_forced_call_may_first_close_the_think_block(tokenizer):
    assert_a_forced_call_waits_for_the_thought(tokenizer, "Paris.</think>", section(PARIS))
