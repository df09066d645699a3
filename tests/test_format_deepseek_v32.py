"""DeepSeek-V3.2's DSML tool calls (formats/deepseek_v32.py): parsed, streamed a
parameter at a time, forced and recognised, on a tiny tokenizer with DeepSeek-V3.2's
added tokens (its DSML token among them)."""

from __future__ import annotations

import json

import pytest

from fixtures.families import FAMILIES, template
from format_support import ADD, EVERY_TYPE, TYPED, WEATHER, accepts, every_way, family_tokenizer, opening_states
from llm_mlx_streaming.formats import deepseek_v31, deepseek_v32
from llm_mlx_streaming.formats.registry import format_of
from llm_mlx_streaming.prompt.tools import forced_call_grammar

TOOLS = [WEATHER, ADD]


def invoke(name: str, arguments: dict) -> str:
    """A call as the template writes one: a string parameter as it is, any other as JSON."""
    parameters = "".join(
        f'<｜DSML｜parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f'{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}</｜DSML｜parameter>\n'
        for key, value in arguments.items())
    return f'<｜DSML｜invoke name="{name}">\n{parameters}</｜DSML｜invoke>'


def block(*invokes: str) -> str:
    return "<｜DSML｜function_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜function_calls>"


@pytest.fixture(scope="module")
def tokenizer():
    """As mlx-lm's conversions ship V3.2: no Jinja template, mlx-lm's renderer named."""
    return family_tokenizer("deepseek_v32", chat_template=None, chat_template_type="deepseek_v32")


def test_the_calls_written_here_are_the_ones_mlx_lms_renderer_writes(tokenizer):
    arguments = {"city": "Paris", "days": 2}
    past = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]}]
    assert block(invoke("get_weather", arguments)) in tokenizer.apply_chat_template(past, tokenize=False)


def test_the_parser_reads_one_call_and_parallel_calls():
    assert deepseek_v32.parse_tool_call(block(invoke("get_weather", {"city": "Paris"}))) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]
    two = block(invoke("get_weather", {"city": "Paris", "days": 2}), invoke("add", {"a": 1, "b": 2.5}))
    assert deepseek_v32.parse_tool_call(two) == [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                                                 {"name": "add", "arguments": {"a": 1, "b": 2.5}}]


def test_the_parser_types_values_by_their_string_attribute():
    [parsed] = deepseek_v32.parse_tool_call(block(invoke("f", EVERY_TYPE)))
    assert parsed["arguments"] == EVERY_TYPE
    as_string = '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="true">3</｜DSML｜parameter>\n'
    assert deepseek_v32.parse_tool_call(as_string) == [{"name": "f", "arguments": {"n": "3"}}]


def test_a_parameter_without_its_string_attribute_is_typed_by_the_schema():
    untyped = ('<｜DSML｜invoke name="book">\n<｜DSML｜parameter name="title">2024</｜DSML｜parameter>\n'
               '<｜DSML｜parameter name="copies">3</｜DSML｜parameter>\n</｜DSML｜invoke>')
    assert deepseek_v32.parse_tool_call(untyped, [TYPED]) == [
        {"name": "book", "arguments": {"title": "2024", "copies": 3}}]


def test_markup_without_a_call_is_no_call():
    with pytest.raises(ValueError):
        deepseek_v32.parse_tool_call("<｜DSML｜parameter name=\"x\" string=\"true\">1</｜DSML｜parameter>")


def test_a_reply_streamed_in_any_pieces_gives_its_reasoning_text_and_calls(tokenizer):
    reply = "The user wants two things.</think>Let me check.\n\n" + block(
        invoke("get_weather", {"city": "Paris", "days": 2}), invoke("add", EVERY_TYPE))
    expected = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                {"name": "add", "arguments": EVERY_TYPE}]
    for pieces, got in every_way(tokenizer, reply, TOOLS, generation_prompt="<｜Assistant｜><think>"):
        assert (got.text("reasoning"), got.text()) == ("The user wants two things.", "Let me check.\n\n"), pieces
        assert got.names() == ["get_weather", "add"] and got.found() == expected, pieces
        assert got.arguments() == [call["arguments"] for call in expected], pieces


def test_a_call_streams_each_parameter_once_it_is_closed(tokenizer):
    from llm_mlx_streaming.prompt.tools import CallReader

    reader = CallReader(tokenizer, TOOLS)
    head = '\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Par'
    assert [(e[0], e[2]) for e in reader.piece(head)] == [("name", "get_weather"), ("arguments", "{")]
    assert reader.piece("is") == []  # the value may go on
    assert [(e[0], e[2]) for e in reader.piece("</｜DSML｜parameter>\n")] == [("arguments", '"city": "Paris"')]


def test_the_forced_grammar_accepts_native_calls_and_refuses_anything_else(tokenizer):
    required = forced_call_grammar(tokenizer, TOOLS, "required")
    one, two = invoke("get_weather", {"city": "Paris"}), invoke("add", {"a": 1, "b": 2.5})
    assert accepts(tokenizer, required, block(one))
    assert accepts(tokenizer, required, block(one, two))
    assert not accepts(tokenizer, required, "It is sunny in Paris.")
    assert not accepts(tokenizer, required, block(invoke("get_weather", {"city": 7})))  # string="false"
    named = forced_call_grammar(tokenizer, TOOLS, "add")
    assert accepts(tokenizer, named, block(two))
    assert not accepts(tokenizer, named, block(one))
    thinking = forced_call_grammar(tokenizer, TOOLS, "required", thinking=True)
    assert accepts(tokenizer, thinking, "A thought.</think>" + block(two))


def test_it_is_found_by_its_dsml_token_before_deepseek_v31_and_thinks_in_think_tags(tokenizer):
    assert "tool_parser_type" not in tokenizer.init_kwargs  # mlx-lm's inference finds no parser
    assert format_of(tokenizer) is deepseek_v32.FORMAT  # V3.1's tags are in its vocabulary too
    assert (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
    assert opening_states(tokenizer) == ("reasoning", "normal")


def test_the_real_template_is_recognised_and_deepseek_v31s_is_not():
    assert deepseek_v32.FORMAT.detect(template("deepseek_v32"), {})
    v31 = {tag: i for i, tag in enumerate(FAMILIES["deepseek_v31"].added)}
    assert not deepseek_v32.FORMAT.detect(template("deepseek_v31"), v31)
    with_template = family_tokenizer("deepseek_v32")
    assert format_of(with_template) is deepseek_v32.FORMAT and format_of(with_template) is not deepseek_v31.FORMAT
