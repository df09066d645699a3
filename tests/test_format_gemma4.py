"""Gemma 4's tool calls (formats/gemma4.py): `<|tool_call>call:NAME{key:value,...}<tool_call|>`
in Gemma's literal syntax (strings between `<|"|>` tokens), read with mlx-lm's gemma4 parser."""

import pytest
from format_support import (TYPED, TYPED_ARGUMENTS, WEATHER, accepts, assert_forces_one_call_or_the_named_one,
                            every_way, family_tokenizer, forced, read_reply, rendered_call, tool)

from llm_mlx_streaming.formats.gemma4 import FORMAT

TOOLS = [WEATHER, TYPED]
PARIS = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
ROME = '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>'
# As the template writes it: the keys sorted, nested values in Gemma's syntax too.
TYPED_CALL = ('<|tool_call>call:book{copies:2,gift:true,price:9.5,shelf:{row:3},'
              'tags:[<|"|>sf<|"|>,<|"|>classic<|"|>],title:<|"|>Dune, 1965 {1st}<|"|>}<tool_call|>')
TYPED_ARGS = {**TYPED_ARGUMENTS, "title": "Dune, 1965 {1st}"}


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("gemma4")


def inner(call: str) -> str:
    return call.removeprefix("<|tool_call>").removesuffix("<tool_call|>")


def test_mlx_lm_infers_gemma4_from_the_real_template(tokenizer):
    assert tokenizer.init_kwargs["tool_parser_type"] == "gemma4"
    assert tokenizer.tool_format is FORMAT
    assert tokenizer.think_start == "<|channel>thought"


def test_the_parser_reads_a_call_and_arguments_of_every_json_type():
    assert FORMAT.parse(inner(PARIS), TOOLS) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert FORMAT.parse(inner(TYPED_CALL), TOOLS) == [{"name": "book", "arguments": TYPED_ARGS}]


def test_the_template_writes_calls_as_the_parser_reads_them(tokenizer):
    calls = [{"name": "book", "arguments": TYPED_ARGS}, {"name": "get_weather", "arguments": {"city": "Paris"}}]
    written = rendered_call(tokenizer, calls, TOOLS)
    assert written == TYPED_CALL + PARIS
    assert read_reply(tokenizer, [written], TOOLS).found() == calls


def test_a_call_streams_its_name_then_each_parameter_however_the_text_is_cut(tokenizer):
    for pieces, reply in every_way(tokenizer, TYPED_CALL, TOOLS):
        assert reply.found() == [{"name": "book", "arguments": TYPED_ARGS}], pieces
        assert reply.arguments() == [TYPED_ARGS], pieces
        assert reply.text() == ""
    # One character at a time: the name once its arguments open, a parameter as the next begins.
    name = reply.when("name")[0]
    assert name == TYPED_CALL.index("{")
    commas = [TYPED_CALL.index(f",{key}:") for key in ("gift", "price", "shelf", "tags", "title")]
    assert sorted(set(reply.when("arguments"))) == [name, *commas, TYPED_CALL.index("}<tool_call|>")]


def test_two_parallel_calls_after_the_thought_channel_come_apart(tokenizer):
    text = f"<|channel>thought\nTwo cities.<channel|>{PARIS}{ROME}"
    for pieces, reply in every_way(tokenizer, text, TOOLS):
        assert reply.names() == ["get_weather", "get_weather"], pieces
        assert reply.arguments() == [{"city": "Paris"}, {"city": "Rome"}]
        assert reply.text("reasoning") == "Two cities." and reply.text() == ""


def test_the_forced_grammar_takes_the_native_calls_and_nothing_else(tokenizer):
    scalars = tool("book", {k: TYPED["function"]["parameters"]["properties"][k] for k in ("title", "copies", "gift")})
    arguments = {"title": "Dune", "copies": 2, "gift": False}
    native = rendered_call(tokenizer, [{"name": "book", "arguments": arguments}], [scalars])
    assert accepts(tokenizer, forced(tokenizer, [scalars]), native)
    grammar = forced(tokenizer, TOOLS)
    # Lists and objects are forced as JSON, which the parser reads as it is.
    as_json = ('<|tool_call>call:book{copies:2,gift:true,price:9.5,shelf:{"row": 3},tags:["sf", "classic"],'
               'title:<|"|>Dune<|"|>}<tool_call|>')
    assert FORMAT.parse(inner(as_json), TOOLS) == [{"name": "book", "arguments": TYPED_ARGUMENTS}]
    for text in (PARIS, as_json, PARIS + ROME, f"{PARIS}\n{ROME}"):
        assert accepts(tokenizer, grammar, text), text
    assert not accepts(tokenizer, grammar, "Paris is sunny.")
    assert not accepts(tokenizer, grammar, PARIS.replace("get_weather", "get_time"))
    assert not accepts(tokenizer, grammar, PARIS.replace('<|"|>', '"'))  # a string is between the tokens
    assert_forces_one_call_or_the_named_one(tokenizer, TOOLS, PARIS, PARIS + ROME, as_json)


def test_a_forced_call_may_first_close_the_thought_channel(tokenizer):
    grammar = forced(tokenizer, [WEATHER], thinking=True)
    assert accepts(tokenizer, grammar, f"Paris.<channel|>{PARIS}")
    reply = read_reply(tokenizer, [f"Paris.<channel|>{PARIS}"], [WEATHER], generation_prompt="<|channel>thought\n")
    assert reply.text("reasoning") == "Paris." and reply.names() == ["get_weather"]


def test_a_reply_after_folded_tool_results_keeps_its_own_token_ids(tokenizer):
    # The results fold into the calling turn (one message fewer): the later reply must
    # still find its own ids, so the next turn reuses its KV (a Codex second turn).
    from llm.parts import Message, TextPart

    from llm_mlx_streaming.prompt.messages import assistant_message, tool_result_message
    from llm_mlx_streaming.prompt.render import render_prompt
    from llm_mlx_streaming.reply.events import ToolCall

    answer = "It is sunny."
    spelled = [i for ch in answer for i in tokenizer.encode(ch, add_special_tokens=False)]  # not how it re-encodes
    assert spelled != tokenizer.encode(answer, add_special_tokens=False)
    call = ToolCall("c1", "get_weather", {"city": "Paris"})
    user = [Message(role="user", parts=[TextPart(text=text)]) for text in ("Weather in Paris?", "And Rome?")]
    for turn in ([user[0], assistant_message("", calls=[call]), tool_result_message("c1", "get_weather", "sunny"),
                  assistant_message(answer, tokens=spelled), user[1]],
                 [user[0], assistant_message("", calls=[call]), tool_result_message("c1", "get_weather", "sunny"),
                  assistant_message(answer, tokens=spelled), user[1], assistant_message("", calls=[call]),
                  tool_result_message("c1", "get_weather", "rainy")]):
        tokens, _, _ = render_prompt(tokenizer, turn, tools=[WEATHER])
        assert any(tokens[i:i + len(spelled)] == spelled for i in range(len(tokens))), tokenizer.decode(tokens)
