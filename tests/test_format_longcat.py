"""Meituan LongCat's tool calls (formats/longcat.py): a <longcat_tool_call> block a call, in
its key/value form or as one JSON object, read with mlx-lm's longcat. No LongCat chat
template is in tests/data/templates (none was found in a public source this project can
read; docs/formats.md): the calls here are the model's writing as mlx-lm's parser and
vLLM's tests show it, on a Qwen3 tokenizer given LongCat's tags."""

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_forces_one_call_or_the_named_one,
                            family_tokenizer, forced, read_reply)

from llm_mlx_streaming.formats.longcat import FORMAT
from llm_mlx_streaming.formats.registry import set_format

TOOLS = [WEATHER, TYPED]
TAGS = ("<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>", "</longcat_arg_key>",
        "<longcat_arg_value>", "</longcat_arg_value>")


def key_value(name, arguments: dict) -> str:
    import json

    pairs = "".join(f"<longcat_arg_key>{k}</longcat_arg_key>\n<longcat_arg_value>"
                    f"{v if isinstance(v, str) else json.dumps(v)}</longcat_arg_value>\n" for k, v in arguments.items())
    return f"<longcat_tool_call>{name}\n{pairs}</longcat_tool_call>"


PARIS, ROME = key_value("get_weather", {"city": "Paris"}), key_value("get_weather", {"city": "Rome"})
TYPED_CALL = key_value("book", TYPED_ARGUMENTS)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = family_tokenizer("qwen3", special=TAGS)
    set_format(tokenizer, FORMAT)
    return tokenizer


def test_the_format_is_recognised_by_its_tags_in_the_template_or_the_vocabulary():
    assert FORMAT.detect("... <longcat_tool_call> ...", {}) and FORMAT.detect("", {"<longcat_tool_call>": 7})
    assert not FORMAT.detect("<tool_call>", {"<tool_call>": 1})


def test_both_forms_are_read_the_key_value_one_streamed_a_parameter_at_a_time(tokenizer):
    json_form = '<longcat_tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</longcat_tool_call>'
    text = f"Checking.\n{TYPED_CALL}\n{json_form}"
    for pieces in ([text], list(text)):
        reply = read_reply(tokenizer, pieces, TOOLS)
        assert reply.found() == [{"name": "book", "arguments": TYPED_ARGUMENTS},
                                 {"name": "get_weather", "arguments": {"city": "Rome"}}]
        assert reply.arguments() == [TYPED_ARGUMENTS, {"city": "Rome"}] and reply.text().strip() == "Checking."
    name = reply.when("name")[0]
    assert name < text.index("<longcat_arg_key>")
    assert len(set(reply.when("arguments"))) > len(TYPED_ARGUMENTS)  # each parameter as it closes


def test_the_forced_grammar_takes_the_key_value_calls_and_nothing_else(tokenizer):
    grammar = forced(tokenizer, TOOLS)
    for text in (PARIS, f"{PARIS}\n{ROME}", TYPED_CALL):
        assert accepts(tokenizer, grammar, text), text
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert not accepts(tokenizer, grammar, PARIS.replace("get_weather", "get_time"))
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, PARIS, f"{PARIS}\n{ROME}", TYPED_CALL)
