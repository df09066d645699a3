"""Qwen3-Coder's tool calls, which Step-3.7-Flash writes too (formats/qwen3_coder.py):
`<function=NAME>` with a `<parameter=KEY>` element a parameter in each `<tool_call>`
block, read with mlx-lm's qwen3_coder parser."""

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_a_forced_call_waits_for_the_thought,
                            assert_forces_one_call_or_the_named_one, every_way, family_tokenizer, forced, read_reply,
                            rendered_call)

from llm_mlx_streaming.formats.qwen3_coder import FORMAT

TOOLS = [WEATHER, TYPED]
PARIS = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
ROME = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
# As the templates write it: a boolean as Python's, lists and objects as JSON.
TYPED_CALL = ("<tool_call>\n<function=book>\n<parameter=title>\nDune\n</parameter>\n"
              "<parameter=copies>\n2\n</parameter>\n<parameter=price>\n9.5\n</parameter>\n<parameter=gift>\nTrue\n</parameter>\n"
              '<parameter=shelf>\n{"row": 3}\n</parameter>\n<parameter=tags>\n["sf", "classic"]\n</parameter>\n'
              "</function>\n</tool_call>")


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("qwen3_coder")


@pytest.fixture(scope="module")
def step():
    return family_tokenizer("step3")


def test_mlx_lm_infers_qwen3_coder_from_the_qwen3_coder_and_step_templates(tokenizer, step):
    for loaded in (tokenizer, step):
        assert loaded.init_kwargs["tool_parser_type"] == "qwen3_coder"
        assert loaded.tool_format is FORMAT


def test_the_parser_reads_a_call_and_arguments_of_every_json_type():
    inner = TYPED_CALL.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert FORMAT.parse(inner, TOOLS) == [{"name": "book", "arguments": TYPED_ARGUMENTS}]


def test_the_templates_write_calls_as_the_parser_reads_them(tokenizer, step):
    calls = [{"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert rendered_call(tokenizer, calls, TOOLS) == f"{TYPED_CALL}\n{PARIS}"
    assert rendered_call(step, calls, TOOLS) == f"{TYPED_CALL}{PARIS}"
    assert read_reply(tokenizer, [f"{TYPED_CALL}\n{PARIS}"], TOOLS).found() == calls


def test_a_call_streams_its_name_then_each_parameter_however_the_text_is_cut(tokenizer):
    for pieces, reply in every_way(tokenizer, TYPED_CALL, TOOLS):
        assert reply.found() == [{"name": "book", "arguments": TYPED_ARGUMENTS}], pieces
        assert reply.arguments() == [TYPED_ARGUMENTS], pieces
        assert reply.text() == ""
    # One character at a time: the name once written, then a parameter as each value closes.
    name = reply.when("name")[0]
    assert name == TYPED_CALL.index(">\n<parameter")
    closes = [i + len("</parameter>") - 1 for i in range(len(TYPED_CALL)) if TYPED_CALL.startswith("</parameter>", i)]
    assert sorted(set(reply.when("arguments"))) == [name, *closes, len(TYPED_CALL) - 1]


def test_two_parallel_calls_after_the_reasoning_step_s_prompt_opened(step):
    text = f"Two cities.\n</think>\n{PARIS}{ROME}"
    for pieces, reply in every_way(step, text, TOOLS, generation_prompt="<|im_start|>assistant\n<think>\n"):
        assert reply.names() == ["get_weather", "get_weather"], pieces
        assert reply.arguments() == [{"city": "Paris"}, {"city": "Rome"}]
        assert reply.text("reasoning").strip() == "Two cities." and reply.text().strip() == ""


def test_the_forced_grammar_takes_the_native_calls_and_nothing_else(tokenizer):
    grammar = forced(tokenizer, TOOLS)
    multiline = PARIS.replace("Paris", "Paris,\nin the spring")
    for text in (PARIS, multiline, TYPED_CALL, TYPED_CALL.replace("True", "true"), f"{PARIS}\n{ROME}", PARIS + ROME):
        assert accepts(tokenizer, grammar, text), text
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert not accepts(tokenizer, grammar, PARIS.replace("get_weather", "get_time"))
    assert not accepts(tokenizer, grammar, TYPED_CALL.replace("\n2\n", "\ntwo\n"))
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, PARIS, f"{PARIS}\n{ROME}", TYPED_CALL)


def test_a_forced_call_may_first_close_the_think_block(step):
    assert_a_forced_call_waits_for_the_thought(step, "Paris.\n</think>\n", PARIS)
