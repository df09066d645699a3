"""MiniMax-M2's tool calls (formats/minimax_m2.py): a `<minimax:tool_call>` block of
`<invoke name=...>` elements with a `<parameter name=...>` element a parameter, read
with mlx-lm's minimax_m2 parser."""

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_a_forced_call_waits_for_the_thought,
                            assert_forces_one_call_or_the_named_one, every_way, family_tokenizer, forced, read_reply,
                            rendered_call)

from llm_mlx_streaming.formats.minimax_m2 import FORMAT

TOOLS = [WEATHER, TYPED]
PROMPT = "]~b]ai\n<think>\n"  # the template's generation prompt opens the think block
PARIS = '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n'
ROME = '<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n</invoke>\n'
TYPED_INVOKE = ('<invoke name="book">\n<parameter name="title">Dune</parameter>\n'
                '<parameter name="copies">2</parameter>\n<parameter name="price">9.5</parameter>\n<parameter name="gift">true</parameter>\n'
                '<parameter name="shelf">{"row": 3}</parameter>\n'
                '<parameter name="tags">["sf", "classic"]</parameter>\n</invoke>\n')


def block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("minimax_m2")


def test_mlx_lm_infers_minimax_m2_from_the_real_template(tokenizer):
    assert tokenizer.init_kwargs["tool_parser_type"] == "minimax_m2"
    assert tokenizer.tool_format is FORMAT
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True).endswith(PROMPT)


def test_the_parser_reads_one_call_several_calls_and_arguments_of_every_json_type():
    assert FORMAT.parse("\n" + PARIS, TOOLS) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert FORMAT.parse("\n" + TYPED_INVOKE + PARIS, TOOLS) == [
        {"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_the_template_writes_calls_as_the_parser_reads_them(tokenizer):
    calls = [{"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    written = rendered_call(tokenizer, calls, TOOLS)
    assert written == block(TYPED_INVOKE, PARIS)
    assert read_reply(tokenizer, [written], TOOLS).found() == calls


def test_calls_stream_their_names_then_each_parameter_however_the_text_is_cut(tokenizer):
    text = block(TYPED_INVOKE, PARIS)
    for pieces, reply in every_way(tokenizer, text, TOOLS):
        assert reply.found() == [{"name": "book", "arguments": TYPED_ARGUMENTS},
                                 {"name": "get_weather", "arguments": {"city": "Paris"}}], pieces
        assert reply.arguments() == [TYPED_ARGUMENTS, {"city": "Paris"}], pieces
        assert reply.text() == ""
    # One character at a time: each name once written, then a parameter as each value closes.
    first, second = reply.when("name")
    assert first < text.index("<parameter") and second < text.index("Paris")
    closes = [i + len("</parameter>") - 1 for i in range(len(text)) if text.startswith("</parameter>", i)]
    assert set(closes[:6]) <= set(reply.when("arguments"))
    assert second < max(reply.when("arguments"))


def test_a_call_after_the_reasoning_the_prompt_opened(tokenizer):
    text = "I will look it up.\n</think>\n\n" + block(PARIS)
    for pieces, reply in every_way(tokenizer, text, TOOLS, generation_prompt=PROMPT):
        assert reply.text("reasoning").strip() == "I will look it up.", pieces
        assert reply.found() == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
        assert reply.text().strip() == ""


def test_the_forced_grammar_takes_the_native_calls_and_nothing_else(tokenizer):
    grammar = forced(tokenizer, TOOLS)
    for text in (block(PARIS), block(TYPED_INVOKE), block(PARIS, ROME), block(TYPED_INVOKE, PARIS)):
        assert accepts(tokenizer, grammar, text), text
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert not accepts(tokenizer, grammar, block(PARIS.replace("get_weather", "get_time")))
    assert not accepts(tokenizer, grammar, "<minimax:tool_call>\n</minimax:tool_call>")
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, block(PARIS), block(PARIS, ROME), block(TYPED_INVOKE))


def test_a_forced_call_may_first_close_the_think_block(tokenizer):
    assert_a_forced_call_waits_for_the_thought(tokenizer, "Paris.\n</think>\n\n", block(PARIS))
