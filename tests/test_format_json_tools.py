"""Qwen3's tool calls (formats/json_tools.py): `{"name": ..., "arguments": {...}}` in each
`<tool_call>` block, read with mlx-lm's json_tools parser, the arguments streamed as written."""

import json

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_a_forced_call_waits_for_the_thought,
                            assert_forces_one_call_or_the_named_one, every_way, family_tokenizer, forced, read_reply,
                            rendered_call)

from llm_mlx_streaming.formats.json_tools import FORMAT

TOOLS = [WEATHER, TYPED]


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


PARIS, ROME = call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Rome"})
TYPED_CALL = call("book", TYPED_ARGUMENTS)


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("qwen3")


def test_mlx_lm_infers_json_tools_from_the_real_template(tokenizer):
    assert tokenizer.init_kwargs["tool_parser_type"] == "json_tools"
    assert tokenizer.tool_format is FORMAT


def test_the_parser_reads_a_call_and_arguments_of_every_json_type():
    inner = TYPED_CALL.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert FORMAT.parse(inner, TOOLS) == [{"name": "book", "arguments": TYPED_ARGUMENTS}]


def test_the_template_writes_calls_as_the_parser_reads_them(tokenizer):
    calls = [{"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    written = rendered_call(tokenizer, calls, TOOLS)
    assert written == f"{TYPED_CALL}\n{PARIS}"
    assert read_reply(tokenizer, [written], TOOLS).found() == calls


def test_a_call_streams_its_name_then_its_arguments_as_written_however_the_text_is_cut(tokenizer):
    for pieces, reply in every_way(tokenizer, TYPED_CALL, TOOLS):
        assert reply.found() == [{"name": "book", "arguments": TYPED_ARGUMENTS}], pieces
        assert reply.arguments() == [TYPED_ARGUMENTS], pieces
        assert reply.text() == ""
    # One character at a time: the name once its arguments begin, and they as they come.
    arguments = TYPED_CALL.index('{"title"')
    assert reply.when("name") == [arguments]
    assert len(set(reply.when("arguments"))) > len(json.dumps(TYPED_ARGUMENTS)) / 2


def test_two_parallel_calls_after_reasoning_come_apart(tokenizer):
    text = f"<think>\nTwo cities.\n</think>\n\n{PARIS}\n{ROME}"
    for pieces, reply in every_way(tokenizer, text, TOOLS):
        assert reply.names() == ["get_weather", "get_weather"], pieces
        assert reply.arguments() == [{"city": "Paris"}, {"city": "Rome"}]
        assert reply.text("reasoning").strip() == "Two cities." and reply.text().strip() == ""
    assert reply.when("name")[1] < text.rindex("Rome")


def test_the_forced_grammar_takes_the_native_calls_and_nothing_else(tokenizer):
    grammar = forced(tokenizer, TOOLS)
    for text in (PARIS, TYPED_CALL, f"{PARIS}\n{ROME}"):
        assert accepts(tokenizer, grammar, text), text
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert not accepts(tokenizer, grammar, call("get_time", {"city": "Paris"}))
    assert not accepts(tokenizer, grammar, call("get_weather", {"town": "Paris"}))
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, PARIS, f"{PARIS}\n{ROME}", TYPED_CALL)


def test_a_forced_call_may_first_close_the_think_block(tokenizer):
    assert_a_forced_call_waits_for_the_thought(tokenizer, "Paris.\n</think>\n\n", PARIS)
