"""GLM-4.5/4.6/4.7's tool calls (formats/glm47.py): `<tool_call>NAME` and a
`<arg_key>`/`<arg_value>` pair a parameter, read with mlx-lm's glm47 parser."""

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_forces_one_call_or_the_named_one,
                            every_way, family_tokenizer, forced, read_reply, rendered_call)

from llm_mlx_streaming.formats.glm47 import FORMAT

TOOLS = [WEATHER, TYPED]
PARIS = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
ROME = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"
# GLM-4.5's and 4.7's way: no line break after the name and between the parameters.
TYPED_CALL = ('<tool_call>book<arg_key>title</arg_key>\n<arg_value>Dune</arg_value><arg_key>copies</arg_key>\n'
              '<arg_value>2</arg_value><arg_key>price</arg_key>\n<arg_value>9.5</arg_value><arg_key>gift</arg_key>\n'
              '<arg_value>true</arg_value><arg_key>shelf</arg_key>\n<arg_value>{"row": 3}</arg_value>'
              '<arg_key>tags</arg_key>\n<arg_value>["sf", "classic"]</arg_value></tool_call>')


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("glm46")


def inner(call: str) -> str:
    return call.removeprefix("<tool_call>").removesuffix("</tool_call>")


@pytest.mark.parametrize("family", ["glm45", "glm46"])
def test_mlx_lm_infers_glm47_from_the_real_templates(family):
    tokenizer = family_tokenizer(family)
    assert tokenizer.init_kwargs["tool_parser_type"] == "glm47"
    assert tokenizer.tool_format is FORMAT
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")


def test_the_parser_reads_a_call_and_arguments_of_every_json_type():
    assert FORMAT.parse(inner(PARIS), TOOLS) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert FORMAT.parse(inner(TYPED_CALL), TOOLS) == [{"name": "book", "arguments": TYPED_ARGUMENTS}]
    assert FORMAT.parse("get_weather\n", TOOLS) == [{"name": "get_weather", "arguments": {}}]


def test_the_templates_write_calls_as_the_parser_reads_them(tokenizer):
    calls = [{"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    for family in ("glm45", "glm46"):
        written = rendered_call(family_tokenizer(family), calls, TOOLS)
        assert read_reply(tokenizer, [written], TOOLS).found() == calls


def test_a_call_streams_its_name_then_each_parameter_however_the_text_is_cut(tokenizer):
    for pieces, reply in every_way(tokenizer, TYPED_CALL, TOOLS):
        assert reply.found() == [{"name": "book", "arguments": TYPED_ARGUMENTS}], pieces
        assert reply.arguments() == [TYPED_ARGUMENTS], pieces
        assert reply.text() == ""
    # One character at a time: the name once written, then a parameter as each value closes.
    name = reply.when("name")[0]
    assert name < TYPED_CALL.index("</arg_key>")
    closes = [i + len("</arg_value>") - 1 for i in range(len(TYPED_CALL)) if TYPED_CALL.startswith("</arg_value>", i)]
    assert sorted(set(reply.when("arguments"))) == [name, *closes, len(TYPED_CALL) - 1]

def test_two_parallel_calls_after_reasoning_come_apart(tokenizer):
    text = f"<think>Two cities.</think>\n{PARIS}\n{ROME}"
    for pieces, reply in every_way(tokenizer, text, TOOLS):
        assert reply.names() == ["get_weather", "get_weather"], pieces
        assert reply.arguments() == [{"city": "Paris"}, {"city": "Rome"}]
        assert reply.text("reasoning") == "Two cities." and reply.text().strip() == ""
    assert reply.when("name")[0] < text.index("</tool_call>")


def test_a_call_with_no_parameters_is_given_when_its_block_closes(tokenizer):
    reply = read_reply(tokenizer, list("<tool_call>get_weather</tool_call>"), TOOLS)
    assert reply.found() == [{"name": "get_weather", "arguments": {}}]
    assert reply.arguments() == [{}]


def test_the_forced_grammar_takes_the_native_calls_and_nothing_else(tokenizer):
    assert tokenizer.encode("<arg_value>", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("<arg_value>")]
    grammar = forced(tokenizer, TOOLS)
    typed = rendered_call(tokenizer, [{"name": "book", "arguments": TYPED_ARGUMENTS}], TOOLS)
    for text in (PARIS, TYPED_CALL, typed, f"{PARIS}\n{ROME}"):
        assert accepts(tokenizer, grammar, text), text
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert not accepts(tokenizer, grammar, PARIS.replace("get_weather", "get_time"))
    assert not accepts(tokenizer, grammar, PARIS.replace("<arg_value>", "").replace("</arg_value>", ""))
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, PARIS, f"{PARIS}\n{ROME}", TYPED_CALL)


def test_a_forced_call_reads_back_as_the_call(tokenizer):
    grammar = forced(tokenizer, [WEATHER], thinking=True)
    text = f"Paris it is.</think>\n{PARIS}"
    assert accepts(tokenizer, grammar, text)
    reply = read_reply(tokenizer, [text], [WEATHER], generation_prompt="<|assistant|>\n<think>")
    assert reply.text("reasoning") == "Paris it is." and reply.found() == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]
