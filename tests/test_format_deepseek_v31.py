"""DeepSeek-V3.1's tool calls (formats/deepseek_v31.py): parsed, streamed, forced and
recognised from the real template, on a tiny tokenizer with DeepSeek's added tokens."""

from __future__ import annotations

import json

import pytest

from fixtures.families import FAMILIES, template
from format_support import ADD, EVERY_TYPE, WEATHER, accepts, every_way, family_tokenizer, opening_states
from llm_mlx_streaming.formats import deepseek_v31
from llm_mlx_streaming.formats.registry import format_of
from llm_mlx_streaming.prompt.tools import forced_call_grammar

TOOLS = [WEATHER, ADD]


def call(name: str, arguments: dict) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(arguments, ensure_ascii=False)}<｜tool▁call▁end｜>"


def section(*calls: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>"


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("deepseek_v31")


def test_the_parser_reads_one_call_and_parallel_calls():
    assert deepseek_v31.parse_tool_call(call("get_weather", {"city": "Paris"})) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]
    two = call("get_weather", {"city": "Paris", "days": 2}) + call("add", {"a": 1, "b": 2.5})
    assert deepseek_v31.parse_tool_call(two) == [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                                                 {"name": "add", "arguments": {"a": 1, "b": 2.5}}]


def test_the_parser_reads_arguments_of_every_json_type():
    [parsed] = deepseek_v31.parse_tool_call(call("f", EVERY_TYPE))
    assert parsed["arguments"] == EVERY_TYPE


def test_the_parser_reads_deepseek_v3s_fenced_calls_and_a_function_named_function():
    fenced = '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
    assert deepseek_v31.parse_tool_call(fenced) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert deepseek_v31.parse_tool_call(call("function", {"x": 1})) == [{"name": "function", "arguments": {"x": 1}}]


def test_markup_without_a_call_is_no_call():
    with pytest.raises(ValueError):
        deepseek_v31.parse_tool_call("just text")


def test_a_reply_streamed_in_any_pieces_gives_its_reasoning_text_and_calls(tokenizer):
    reply = ("The user wants two things.</think>Let me check." + section(
        call("get_weather", {"city": "Paris", "days": 2}), call("add", EVERY_TYPE)))
    expected = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                {"name": "add", "arguments": EVERY_TYPE}]
    for pieces, got in every_way(tokenizer, reply, TOOLS, generation_prompt="<｜Assistant｜><think>"):
        assert (got.text("reasoning"), got.text()) == ("The user wants two things.", "Let me check."), pieces
        assert got.names() == ["get_weather", "add"] and got.found() == expected, pieces
        assert got.arguments() == [call["arguments"] for call in expected], pieces


def test_a_fenced_call_streams_its_arguments_without_the_fence(tokenizer):
    reply = section('<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```'
                    '<｜tool▁call▁end｜>')
    for pieces, got in every_way(tokenizer, reply, TOOLS, generation_prompt="<｜Assistant｜></think>"):
        assert got.text() == "" and got.found() == [{"name": "get_weather", "arguments": {"city": "Paris"}}], pieces
        assert got.arguments() == [{"city": "Paris"}], pieces


def test_the_forced_grammar_accepts_native_calls_and_refuses_anything_else(tokenizer):
    required = forced_call_grammar(tokenizer, TOOLS, "required")
    one, two = call("get_weather", {"city": "Paris"}), call("add", {"a": 1, "b": 2})
    assert accepts(tokenizer, required, section(one))
    assert accepts(tokenizer, required, section(one, two))
    assert not accepts(tokenizer, required, "It is sunny in Paris.")
    assert not accepts(tokenizer, required, section(call("get_weather", {"town": "Paris"})))
    named = forced_call_grammar(tokenizer, TOOLS, "add")
    assert accepts(tokenizer, named, section(two))
    assert not accepts(tokenizer, named, section(one))
    thinking = forced_call_grammar(tokenizer, TOOLS, "required", thinking=True)
    assert accepts(tokenizer, thinking, "A thought.</think>" + section(two))
    assert not accepts(tokenizer, thinking, section(two))  # still inside the think block


def test_it_is_found_from_the_real_template_and_thinks_in_think_tags(tokenizer):
    assert "tool_parser_type" not in tokenizer.init_kwargs  # mlx-lm's inference finds no parser
    assert format_of(tokenizer) is deepseek_v31.FORMAT and tokenizer.has_tool_calling
    assert (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
    assert opening_states(tokenizer) == ("reasoning", "normal")


def test_the_template_and_vocabulary_are_what_it_is_recognised_by():
    assert deepseek_v31.FORMAT.detect(template("deepseek_v31"), {})
    assert deepseek_v31.FORMAT.detect("", {tag: i for i, tag in enumerate(FAMILIES["deepseek_v31"].added)})
    assert not deepseek_v31.FORMAT.detect("{{ messages }}", {"<think>": 1, "</think>": 2})


# The model card's "ToolCall" section: the tools follow the system prompt, described so.
DECLARED = (
    "## Tools\nYou have access to the following tools:\n\n"
    "### get_weather\nDescription: get_weather something\n\nParameters: "
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}\n\n'
    "### add\nDescription: add something\n\nParameters: "
    '{"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}\n\n'
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>"
    "{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\n"
    "Where:\n\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n")


def test_the_tools_its_template_never_renders_are_described_after_the_system_prompt_as_its_card_says(tokenizer):
    from llm.parts import Message, TextPart

    from llm_mlx_streaming.prompt.render import render_prompt

    def rendered(*messages, tools=TOOLS):
        tokens, _, _ = render_prompt(tokenizer, [Message(role=role, parts=[TextPart(text=text)]) for role, text in messages],
                                  thinking=False, tools=tools)  # the card's calls are in non-thinking mode
        return tokenizer.decode(tokens)

    asked = "<｜User｜>Weather in Paris?<｜Assistant｜></think>"
    assert rendered(("system", "Be brief."), ("user", "Weather in Paris?")) == (
        f"<｜begin▁of▁sentence｜>Be brief.\n\n{DECLARED}{asked}")
    assert rendered(("user", "Weather in Paris?")) == f"<｜begin▁of▁sentence｜>{DECLARED}{asked}"
    assert rendered(("user", "Weather in Paris?"), tools=None) == f"<｜begin▁of▁sentence｜>{asked}"


def test_with_the_tools_declared_in_a_system_message_of_their_own_a_reply_keeps_its_token_ids(tokenizer):
    from llm.parts import Message, TextPart

    from llm_mlx_streaming.prompt.messages import assistant_message
    from llm_mlx_streaming.prompt.render import render_prompt

    answer = "Hello there."
    spelled = [i for ch in answer for i in tokenizer.encode(ch, add_special_tokens=False)]  # not how it re-encodes
    assert spelled != tokenizer.encode(answer, add_special_tokens=False)
    turn = [Message(role="user", parts=[TextPart(text="Hi")]), assistant_message(answer, tokens=spelled),
            Message(role="user", parts=[TextPart(text="Weather in Paris?")])]
    tokens, _, _ = render_prompt(tokenizer, turn, thinking=False, tools=TOOLS)
    assert DECLARED in tokenizer.decode(tokens)
    assert any(tokens[i:i + len(spelled)] == spelled for i in range(len(tokens)))
