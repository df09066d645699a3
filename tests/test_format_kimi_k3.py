"""Kimi-K3's tool calls (formats/kimi_k3.py): an XTML tools section of call elements, an
argument element a parameter typed by its type attribute, read with mlx-lm's kimi_k3."""

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_forces_one_call_or_the_named_one,
                            every_way, family_tokenizer, forced, read_reply, rendered_call)

from llm_mlx_streaming.formats.kimi_k3 import FORMAT

TOOLS = [WEATHER, TYPED]
ON = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'  # the generation prompt, thinking on
OFF = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'


def argument(key, kind, value):
    return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'


def call(name, index, *arguments):
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>' + "".join(arguments) + "<|close|>call<|sep|>"


def tools(*calls):
    return "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>"


PARIS = call("get_weather", 1, argument("city", "string", "Paris"))
ROME = call("get_weather", 2, argument("city", "string", "Rome"))
TYPED_CALL = call("book", 1, argument("title", "string", "Dune"), argument("copies", "number", "2"),
                  argument("price", "number", "9.5"), argument("gift", "boolean", "true"),
                  argument("shelf", "object", '{"row": 3}'), argument("tags", "array", '["sf", "classic"]'))


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("kimi_k3")


def test_mlx_lm_infers_kimi_k3_from_the_xtml_vocabulary_and_so_is_it_recognised(tokenizer):
    assert tokenizer.init_kwargs["tool_parser_type"] == "kimi_k3" and tokenizer.tool_format is FORMAT
    assert (tokenizer.think_start, tokenizer.think_end) == ("<|open|>think<|sep|>", "<|close|>think<|sep|>")
    assert FORMAT.detect(tokenizer.chat_template, {}) and not FORMAT.detect("", {"<|open|>": 1})
    user = [{"role": "user", "content": "hi"}]
    for thinking, end in ((True, ON), (False, OFF)):
        assert tokenizer.apply_chat_template(user, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                             thinking=thinking).endswith(end)


def test_the_template_writes_calls_as_the_parser_reads_them(tokenizer):
    calls = [{"name": "book", "arguments": TYPED_ARGUMENTS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    written = rendered_call(tokenizer, calls, TOOLS)
    assert written == tools(TYPED_CALL, call("get_weather", 2, argument("city", "string", "Paris")))
    assert read_reply(tokenizer, [written], TOOLS).found() == calls


def test_calls_stream_their_names_then_each_argument_however_the_text_is_cut(tokenizer):
    text = tools(TYPED_CALL, ROME)
    for pieces, reply in every_way(tokenizer, text, TOOLS):
        assert reply.found() == [{"name": "book", "arguments": TYPED_ARGUMENTS},
                                 {"name": "get_weather", "arguments": {"city": "Rome"}}], pieces
        assert reply.arguments() == [TYPED_ARGUMENTS, {"city": "Rome"}], pieces
        assert reply.text() == ""
    first, second = reply.when("name")
    assert first < text.index("Dune") and second < text.index("Rome")
    closes = [i + len("<|close|>argument<|sep|>") - 1 for i in range(len(text))
              if text.startswith("<|close|>argument<|sep|>", i) and i < text.index("<|close|>call")]
    assert sorted(set(reply.when("arguments")))[:len(closes) + 1] == [first, *closes]


def test_a_reply_reasons_answers_and_calls_with_the_response_block_out_of_the_text(tokenizer):
    text = ("Two cities.<|close|>think<|sep|><|open|>response<|sep|>Looking.<|close|>response<|sep|>"
            + tools(PARIS, ROME) + "<|close|>message<|sep|>")
    for pieces in ([text], list(text)):
        reply = read_reply(tokenizer, pieces, TOOLS, generation_prompt=ON)
        assert reply.text("reasoning") == "Two cities." and reply.text() == "Looking."
        assert reply.arguments() == [{"city": "Paris"}, {"city": "Rome"}]


def test_the_forced_grammar_takes_the_native_calls_after_the_response_block_and_nothing_else(tokenizer):
    grammar = forced(tokenizer, TOOLS)
    lead = "<|close|>response<|sep|>"
    for text in (tools(PARIS), tools(TYPED_CALL), tools(PARIS, ROME)):
        assert accepts(tokenizer, grammar, lead + text), text
        assert not accepts(tokenizer, grammar, text)  # the response block the prompt opened is closed first
    assert not accepts(tokenizer, grammar, lead + "Paris is sunny.")
    assert not accepts(tokenizer, grammar, lead + tools(PARIS.replace('"string"', '"number"')))
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, lead + tools(PARIS), lead + tools(PARIS, ROME),
                                            lead + tools(TYPED_CALL))


def test_a_forced_call_after_thinking_closes_the_thought_and_opens_the_response(tokenizer):
    grammar = forced(tokenizer, [WEATHER], thinking=True)
    text = "Paris.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>" + tools(PARIS)
    assert accepts(tokenizer, grammar, text)
    assert not accepts(tokenizer, grammar, "<|close|>response<|sep|>" + tools(PARIS))
    reply = read_reply(tokenizer, [text], [WEATHER], generation_prompt=ON)
    assert reply.text("reasoning") == "Paris." and reply.found() == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]
