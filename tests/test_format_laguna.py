"""Poolside Laguna's tool calls (formats/laguna.py): GLM-4.7's markup in <tool_call>
blocks, read with mlx-lm's laguna (its glm47), the format recognised by the template
before mlx-lm's inference takes it for GLM's."""

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_a_forced_call_waits_for_the_thought,
                            assert_forces_one_call_or_the_named_one, every_way, family_tokenizer, forced, read_reply,
                            rendered_call)

from llm_mlx_streaming.formats.laguna import FORMAT

TOOLS = [WEATHER, TYPED]
PARIS = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
ROME = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("laguna")


def test_the_template_is_recognised_as_lagunas_before_mlx_lm_takes_it_for_glms(tokenizer):
    assert tokenizer.init_kwargs["tool_parser_type"] == "glm47" and tokenizer.tool_format is FORMAT
    assert not FORMAT.detect(family_tokenizer("glm46").chat_template, {})
    named = family_tokenizer("glm46", tool_parser_type="laguna")  # as checkpoints mlx-lm converts name it
    assert named.tool_format is FORMAT
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")


def test_the_template_writes_calls_as_the_parser_reads_them(tokenizer):
    calls = [{"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    written = rendered_call(tokenizer, calls, TOOLS)
    assert written.endswith(PARIS)
    assert read_reply(tokenizer, [written], TOOLS).found() == calls


def test_calls_after_reasoning_stream_their_names_then_each_parameter(tokenizer):
    text = f"\nTwo cities.\n</think>\n{PARIS}\n{ROME}\n"
    for pieces, reply in every_way(tokenizer, text, TOOLS, generation_prompt="<assistant>\n<think>"):
        assert reply.text("reasoning") == "Two cities.\n" and reply.text().strip() == "", pieces
        assert reply.arguments() == [{"city": "Paris"}, {"city": "Rome"}], pieces
    assert reply.when("name")[0] < text.index("<arg_key>")


def test_the_forced_grammar_takes_the_native_calls_and_waits_for_the_thought(tokenizer):
    grammar = forced(tokenizer, TOOLS)
    typed = rendered_call(tokenizer, [{"name": "book", "arguments": TYPED_ARGUMENTS}], TOOLS)
    for text in (PARIS, f"{PARIS}\n{ROME}", typed):
        assert accepts(tokenizer, grammar, text), text
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, PARIS, f"{PARIS}\n{ROME}", typed)
    assert_a_forced_call_waits_for_the_thought(tokenizer, "Paris.\n</think>\n", PARIS)
