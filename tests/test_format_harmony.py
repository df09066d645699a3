"""gpt-oss's harmony format (formats/harmony.py): a call parsed, the reply's channels
split and its call streamed, a call forced, the format recognised from the real
template, on a tiny tokenizer with gpt-oss's special tokens."""

from __future__ import annotations

import json

import pytest

from fixtures.families import FAMILIES, template
from format_support import ADD, EVERY_TYPE, WEATHER, accepts, every_way, family_tokenizer, matcher
from llm_mlx_streaming.formats.forcing import literal
from llm_mlx_streaming.formats import harmony
from llm_mlx_streaming.formats.registry import format_of
from llm_mlx_streaming.prompt.split import initial_state
from llm_mlx_streaming.prompt.tools import forced_call_grammar

TOOLS = [WEATHER, ADD]

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"


def to_functions(name: str, arguments: dict) -> str:
    """A call as gpt-oss writes it: the recipient in the channel header."""
    return (f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            + json.dumps(arguments, ensure_ascii=False))


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("gpt_oss")


def test_the_parser_reads_a_call_with_its_recipient_in_either_header():
    assert harmony.parse_tool_call('get_weather <|constrain|>json<|message|>{"city": "Paris"}') == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    assert harmony.parse_tool_call('get_weather<|channel|>commentary json<|message|>{"city": "Paris"}') == {
        "name": "get_weather", "arguments": {"city": "Paris"}}


def test_the_parser_reads_arguments_of_every_json_type():
    text = "f <|constrain|>json<|message|>" + json.dumps(EVERY_TYPE)
    assert harmony.parse_tool_call(text)["arguments"] == EVERY_TYPE


def test_a_header_without_a_message_is_no_call():
    with pytest.raises(ValueError):
        harmony.parse_tool_call("get_weather <|constrain|>json")


@pytest.mark.parametrize("reply, reasoning, text, calls", [
    (ANALYSIS + to_functions("get_weather", {"city": "Paris", "days": 2}),
     "The user wants the weather.", "", [("get_weather", {"city": "Paris", "days": 2})]),
    (ANALYSIS + "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>" + json.dumps(EVERY_TYPE),
     "The user wants the weather.", "", [("add", EVERY_TYPE)]),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me look that up.<|end|>"
     + to_functions("get_weather", {"city": "Paris"}),
     "The user wants the weather.", "Let me look that up.", [("get_weather", {"city": "Paris"})]),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.",
     "The user wants the weather.", "It is sunny in Paris.", []),
    (ANALYSIS + to_functions("get_weather", {"city": "Paris"}) + "<|call|>",
     "The user wants the weather.", "", [("get_weather", {"city": "Paris"})]),
], ids=["call", "recipient in the role header", "preamble then call", "final answer", "<|call|> in the text"])
def test_a_reply_streamed_in_any_pieces_gives_its_channels_and_call(tokenizer, reply, reasoning, text, calls):
    for pieces, got in every_way(tokenizer, reply, TOOLS, generation_prompt="<|start|>assistant"):
        assert (got.text("reasoning"), got.text()) == (reasoning, text), pieces
        assert got.names() == [name for name, _ in calls], pieces
        assert got.found() == [{"name": name, "arguments": arguments} for name, arguments in calls], pieces
        assert got.arguments() == [arguments for _, arguments in calls], pieces


NATIVE_CALL = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2.5}'


def call_grammar(tokenizer, functions) -> str:
    """The format's call grammar behind the channel header gpt-oss writes, as
    forced_call_grammar composes it with the format's lead, <|channel|> its token."""
    import llguidance

    from llm_mlx_streaming.prompt.tools import _Lark

    lark = _Lark(tokenizer)
    lines = harmony.FORMAT.grammar(lark, functions)
    calls = " | ".join(f"call{i}" for i in range(len(functions)))
    lines.append(f'start: {lark.tag("<|channel|>")} "commentary " {literal(harmony.tool_call_start)} ({calls})')
    return llguidance.grammar_from("lark", "\n".join(lines))


def test_the_call_grammar_takes_the_call_as_gpt_oss_writes_it_and_then_the_turn_ends(tokenizer):
    m = matcher(tokenizer, call_grammar(tokenizer, [t["function"] for t in TOOLS]))
    assert m.consume_tokens(tokenizer.encode(NATIVE_CALL, add_special_tokens=False)) and m.is_accepting()
    assert m.consume_token(tokenizer.convert_tokens_to_ids("<|call|>")) and m.is_stopped()
    assert not accepts(tokenizer, call_grammar(tokenizer, [WEATHER["function"]]), NATIVE_CALL)  # not named


@pytest.mark.parametrize("wrong", [
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town": "Paris"}',
    "<|channel|>commentary to=functions.add is what I would call",
    '<|channel|>final<|message|>{"a": 1, "b": 2.5}',
])
def test_the_call_grammar_refuses_anything_but_a_call(tokenizer, wrong):
    assert not accepts(tokenizer, call_grammar(tokenizer, [t["function"] for t in TOOLS]), wrong)


def test_the_forced_grammar_takes_the_call_as_gpt_oss_writes_it(tokenizer):
    assert accepts(tokenizer, forced_call_grammar(tokenizer, TOOLS, "required"), NATIVE_CALL)


def test_it_is_found_from_the_real_template_and_the_reply_starts_in_a_header(tokenizer):
    assert "tool_parser_type" not in tokenizer.init_kwargs  # mlx-lm's inference finds no parser
    assert format_of(tokenizer) is harmony.FORMAT and tokenizer.has_tool_calling and not tokenizer.has_thinking
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True, reasoning_effort="high")
    assert "Reasoning: high" in prompt and "type get_weather = " in prompt and prompt.endswith("<|start|>assistant")
    assert initial_state(tokenizer, "<|start|>assistant") == "header"


def test_the_template_and_vocabulary_are_what_it_is_recognised_by():
    published = template("gpt_oss")
    assert "<|constrain|>" not in published  # it comes from the vocabulary
    assert harmony.FORMAT.detect(published, {"<|constrain|>": 200003})
    assert harmony.FORMAT.detect("", {tag: i for i, tag in enumerate(FAMILIES["gpt_oss"].special)})
    assert not harmony.FORMAT.detect(published, {})


def _capped_continuation(tokenizer, tools, continuation: str) -> list[str]:
    """How a thinking budget of 4 takes each token of `continuation`, written by gpt-oss
    after an analysis the budget closed ("forced", "allowed" among others, "free" of any
    constraint, "refused"), the cap as a request with `tools` gets it, driven one token a
    step as mlx-lm drives it."""
    import mlx.core as mx

    from llm_mlx_streaming.reply.build import _reasoning_cap

    prompt = tokenizer.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant", add_special_tokens=False)
    (cap,) = _reasoning_cap(tokenizer, prompt, "<|start|>assistant", 4, 100, tools)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    reply, allowed = encode("<|channel|>analysis<|message|>") + encode("I should look this up") * 2, []
    reply = reply[:len(encode("<|channel|>analysis<|message|>")) + 4]
    for token in [*encode("<|end|>"), *encode(continuation)]:
        row = cap(mx.array(prompt + reply), mx.zeros((1, len(tokenizer.get_vocab()))))[0].tolist()
        open_ = sum(v == 0 for v in row)
        allowed.append("refused" if row[token] != 0 else "forced" if open_ == 1 else
                       "free" if open_ == len(row) else "allowed")
        reply.append(token)
    return allowed


@pytest.mark.parametrize("continuation", [
    "<|start|>assistant" + NATIVE_CALL + "<|call|>",
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>",
], ids=["a call", "the answer"])
def test_a_reasoning_closed_by_its_budget_is_followed_by_the_answer_or_a_call_as_the_model_chooses(
        tokenizer, continuation):
    """The budget forces the analysis channel's end only; the model then writes the final
    channel, or a call in the commentary channel (a capped reasoning may still call a
    tool), each token as it would (the grammar lets go once the header or call is whole)."""
    taken = _capped_continuation(tokenizer, TOOLS, continuation)
    assert taken[:2] == ["forced", "forced"] and "refused" not in taken, taken  # <|end|><|start|>
    assert "allowed" in taken and taken[-1] == "free", taken


@pytest.mark.parametrize("continuation", [
    "<|start|>assistant<|channel|>analysis<|message|>More thought.",
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town": "Paris"}',
], ids=["more analysis", "a call off its schema"])
def test_after_a_budget_neither_more_analysis_nor_a_call_off_its_schema_can_follow(tokenizer, continuation):
    assert "refused" in _capped_continuation(tokenizer, TOOLS, continuation)


def test_without_tools_the_budget_forces_the_final_channel_as_before(tokenizer):
    header, answer = "<|start|>assistant<|channel|>final<|message|>", "Sunny."
    taken = _capped_continuation(tokenizer, [], header + answer)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert taken == ["forced"] * (1 + count(header)) + ["free"] * count(answer)
    assert "refused" in _capped_continuation(tokenizer, [], "<|start|>assistant" + NATIVE_CALL)
