"""Mistral's tool calls (formats/mistral.py): `[TOOL_CALLS]NAME[ARGS]{json}` a call, or the
older list `[TOOL_CALLS] [{"name": ..., "arguments": ..., "id": ...}]` that the Small 3.1
template writes; no end tag (the turn's end closes the block); mlx-lm's mistral parser."""

import json

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_forces_one_call_or_the_named_one,
                            every_way, family_tokenizer, forced, read_reply, rendered_call)

from llm_mlx_streaming.formats.mistral import FORMAT

TOOLS = [WEATHER, TYPED]


def call(name: str, arguments: dict) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}"


PARIS, ROME, TYPED_CALL = call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Rome"}), call(
    "book", TYPED_ARGUMENTS)
LISTED = ('[TOOL_CALLS] [{"name": "book", "arguments": ' + json.dumps(TYPED_ARGUMENTS) + ', "id": "000000000"}, '
          '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "000000001"}]')


@pytest.fixture(scope="module")
def tokenizer():
    """Small 3.1's, and the [ARGS] token of the later tokenizers (Mistral 4's) that write calls with it."""
    return family_tokenizer("mistral", special=("[ARGS]",))


def test_mlx_lm_infers_mistral_from_the_real_template(tokenizer):
    assert tokenizer.init_kwargs["tool_parser_type"] == "mistral"
    assert tokenizer.tool_format is FORMAT
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("[TOOL_CALLS]", "")


def test_the_parser_reads_both_ways_of_writing_calls():
    assert FORMAT.parse(TYPED_CALL.removeprefix("[TOOL_CALLS]"), TOOLS) == [
        {"name": "book", "arguments": TYPED_ARGUMENTS}]
    assert FORMAT.parse(PARIS.removeprefix("[TOOL_CALLS]") + ROME, TOOLS) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]
    assert FORMAT.parse(LISTED.removeprefix("[TOOL_CALLS]"), TOOLS) == [
        {"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_the_template_writes_calls_as_the_parser_reads_them(tokenizer):
    calls = [{"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert rendered_call(tokenizer, calls, TOOLS) == LISTED
    assert read_reply(tokenizer, [LISTED], TOOLS).found() == calls


@pytest.mark.parametrize("text, expected", [(PARIS + TYPED_CALL, [{"city": "Paris"}, TYPED_ARGUMENTS]),
                                            (LISTED, [TYPED_ARGUMENTS, {"city": "Paris"}])], ids=["args", "listed"])
def test_calls_stream_their_names_then_their_arguments_as_written_however_the_text_is_cut(tokenizer, text, expected):
    for pieces, reply in every_way(tokenizer, text, TOOLS):
        assert [c["arguments"] for c in reply.found()] == expected, pieces
        assert reply.arguments() == expected, pieces
        assert reply.text() == ""
    # One character at a time: each name before its first argument is written, and they as they come.
    names = reply.when("name")
    assert names == sorted(names) and all(at < text.index(f'"{next(iter(a))}"') for at, a in zip(names, expected))
    arguments = reply.when("arguments")
    assert len(set(arguments)) > len(json.dumps(TYPED_ARGUMENTS)) / 2


def test_the_forced_grammar_takes_the_native_calls_and_nothing_else(tokenizer):
    grammar = forced(tokenizer, TOOLS)
    for text in (PARIS, TYPED_CALL, PARIS + ROME):
        assert accepts(tokenizer, grammar, text), text
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert not accepts(tokenizer, grammar, call("get_time", {"city": "Paris"}))
    assert not accepts(tokenizer, grammar, PARIS.replace("[ARGS]", ""))
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, PARIS, PARIS + ROME, TYPED_CALL)


def test_forced_parallel_calls_read_back_as_calls(tokenizer):
    assert read_reply(tokenizer, [PARIS + ROME], TOOLS).found() == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]
