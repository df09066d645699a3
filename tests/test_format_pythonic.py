"""LFM2/LFM2.5's tool calls (formats/pythonic.py): a Python list of calls in a
`<|tool_call_start|>` block, read with mlx-lm's pythonic parser."""

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_forces_one_call_or_the_named_one,
                            every_way, family_tokenizer, forced, read_reply, rendered_call, tool)

from llm_mlx_streaming.formats.pythonic import FORMAT

TOOLS = [WEATHER, TYPED]
PARIS = '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>'
ROME = '<|tool_call_start|>[get_weather(city="Rome")]<|tool_call_end|>'
# As the template writes it: strings in single quotes, booleans and lists as Python's, objects as JSON.
TYPED_CALL = ("<|tool_call_start|>[book(title='Dune, (1965)', copies=2, price=9.5, gift=True, shelf={\"row\": 3}, "
              "tags=['sf', 'classic']), get_weather(city='Paris')]<|tool_call_end|>")
TYPED_ARGS = {**TYPED_ARGUMENTS, "title": "Dune, (1965)"}


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("lfm2")


def inner(call: str) -> str:
    return call.removeprefix("<|tool_call_start|>").removesuffix("<|tool_call_end|>")


def test_mlx_lm_infers_pythonic_from_the_real_template(tokenizer):
    assert tokenizer.init_kwargs["tool_parser_type"] == "pythonic"
    assert tokenizer.tool_format is FORMAT


def test_the_parser_reads_one_call_two_calls_and_arguments_of_every_json_type():
    assert FORMAT.parse(inner(PARIS), TOOLS) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert FORMAT.parse(inner(TYPED_CALL), TOOLS) == [
        {"name": "book", "arguments": TYPED_ARGS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert FORMAT.parse('[book(gift=true, shelf={"row": null})]', TOOLS) == [
        {"name": "book", "arguments": {"gift": True, "shelf": {"row": None}}}]


def test_the_template_writes_calls_as_the_parser_reads_them(tokenizer):
    calls = [{"name": "book", "arguments": TYPED_ARGS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    written = rendered_call(tokenizer, calls, TOOLS)
    assert written == TYPED_CALL
    assert read_reply(tokenizer, [written], TOOLS).found() == calls


def test_calls_stream_their_names_then_each_parameter_however_the_text_is_cut(tokenizer):
    for pieces, reply in every_way(tokenizer, TYPED_CALL, TOOLS):
        assert reply.found() == [{"name": "book", "arguments": TYPED_ARGS},
                                 {"name": "get_weather", "arguments": {"city": "Paris"}}], pieces
        assert reply.arguments() == [TYPED_ARGS, {"city": "Paris"}], pieces
        assert reply.text() == ""
    # One character at a time: a name once its arguments open, a parameter as the next begins.
    first, second = reply.when("name")
    assert first == TYPED_CALL.index("(") and second == TYPED_CALL.index("(city")
    commas = [TYPED_CALL.index(f", {key}=") for key in ("copies", "price", "gift", "shelf", "tags")]
    assert set(commas) <= set(reply.when("arguments"))
    assert max(reply.when("arguments")) == TYPED_CALL.rindex(")")  # done at its closing bracket, before the end tag


def test_a_call_after_reasoning(tokenizer):
    text = f"<think>Paris, then.</think>{PARIS}"
    for pieces, reply in every_way(tokenizer, text, TOOLS):
        assert reply.text("reasoning") == "Paris, then.", pieces
        assert reply.found() == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
        assert reply.text() == ""


def test_the_forced_grammar_takes_a_native_call_and_nothing_else(tokenizer):
    scalars = tool("book", {k: TYPED["function"]["parameters"]["properties"][k]
                            for k in ("title", "copies", "price", "gift")})
    arguments = {"title": "Dune", "copies": 2, "price": 9.5, "gift": True}
    native = rendered_call(tokenizer, [{"name": "book", "arguments": arguments}], [scalars])
    assert accepts(tokenizer, forced(tokenizer, [scalars]), native)
    grammar = forced(tokenizer, TOOLS)
    as_json = ('<|tool_call_start|>[book(title="Dune", copies=2, price=9.5, gift=true, shelf={"row": 3}, '
               'tags=["sf", "classic"])]<|tool_call_end|>')
    for text in (PARIS, as_json, PARIS + ROME):  # forced calls of one turn: a block each
        assert accepts(tokenizer, grammar, text), text
    assert read_reply(tokenizer, [PARIS + ROME], TOOLS).found() == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert not accepts(tokenizer, grammar, PARIS.replace("get_weather", "get_time"))
    assert not accepts(tokenizer, grammar, PARIS.replace('"Paris"', "Paris"))
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, PARIS, PARIS + ROME, as_json)
