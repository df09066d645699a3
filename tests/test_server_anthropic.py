"""The Anthropic Messages API of `llm mlxs serve`, driven by the official `anthropic`
client against a server on a free loopback port (stopped at the end)."""

from __future__ import annotations

import json

import pytest

from server_support import call, in_process, served, small_server  # noqa: F401 (served: a fixture)
from test_server_tools import ADD as OPENAI_ADD, ASK, CALL, tooled  # noqa: F401 (tooled: a fixture)

HELLO = [{"role": "user", "content": "hello there"}]


def client(served, **kwargs):
    import anthropic

    return anthropic.Anthropic(base_url=served.server.url, api_key="unused", max_retries=0, timeout=60, **kwargs)


def test_a_reply_equals_the_in_process_greedy_reply_whole_and_streamed(served):
    expected = in_process([{"role": "system", "content": "be brief"}, *HELLO], max_tokens=10)
    c = client(served)
    reply = c.messages.create(model="sm", system="be brief", messages=HELLO, max_tokens=10)
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == expected
    assert reply.model == "mlx-stream/small" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert reply.usage.output_tokens == 10 and reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0

    with c.messages.stream(model="mlx-stream", system=[{"type": "text", "text": "be brief"}], messages=HELLO,
                           max_tokens=10) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == expected and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "message_delta" in kinds


def test_stop_sequences_seed_and_kv_reuse(served):
    c = client(served)
    full = c.messages.create(model="mlx-stream", messages=HELLO, max_tokens=12).content[0].text
    stop = full[4:7]
    cut = c.messages.create(model="mlx-stream", messages=HELLO, max_tokens=12, stop_sequences=[stop, "zzz"])
    assert cut.content[0].text == full[: full.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)

    sampled = [c.messages.create(model="mlx-stream", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                 extra_body={"temperature": 1.0, "seed": 3}).content[0].text for _ in range(2)]
    call(served, "POST", "/v1/messages", {"messages": HELLO, "max_tokens": 3})  # something else in between
    sampled.append(c.messages.create(model="mlx-stream", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=8, extra_body={"temperature": 1.0, "seed": 3}).content[0].text)
    assert sampled == [sampled[0]] * 3

    first = c.messages.create(model="mlx-stream", messages=[{"role": "user", "content": "one"}], max_tokens=6)
    follow = c.messages.create(model="mlx-stream", max_tokens=6, messages=[
        {"role": "user", "content": "one"}, {"role": "assistant", "content": first.content},
        {"role": "user", "content": "two"}])
    stats = follow.model_extra["mlx_stream"]["stats"]
    first_prompt = first.model_extra["mlx_stream"]["stats"]["prompt_tokens"]
    assert stats["reused_tokens"] >= first_prompt + 5  # the first turn and its reply
    assert follow.usage.cache_read_input_tokens == stats["reused_tokens"]


def test_count_tokens_is_the_prompt_a_reply_prefills(served):
    c = client(served)
    counted = c.messages.count_tokens(model="mlx-stream", system="be brief", messages=HELLO).input_tokens
    reply = c.messages.create(model="mlx-stream", system="be brief", messages=HELLO, max_tokens=2)
    assert counted == reply.model_extra["mlx_stream"]["stats"]["prompt_tokens"] > 0


def test_engine_options_and_json_output_are_honoured(served):
    import json

    c = client(served)
    reply = c.messages.create(model="mlx-stream", messages=HELLO, max_tokens=4, extra_body={"expert_slots": 2})
    assert reply.model_extra["mlx_stream"]["stats"]["expert_slots"] == 2
    schema = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
    reply = c.messages.create(model="mlx-stream", messages=HELLO, max_tokens=40,
                              extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert set(json.loads(reply.content[0].text)) == {"word"}


@pytest.mark.parametrize("body,needle", [
    ({"messages": HELLO}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 4, "stop": ["x"]}, "stop"),
    ({"messages": HELLO, "max_tokens": 4, "expert_slots": 0}, "expert_slots"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}],
      "max_tokens": 4}, "messages.0.content.0: a file source"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "The answer is"}], "max_tokens": 4}, "messages"),
    ({"messages": HELLO, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 0}}, "budget_tokens"),
    ({"messages": HELLO, "max_tokens": 4, "thinking_budget": 3}, "thinking_budget"),
    ({"messages": HELLO, "max_tokens": 4, "model": "claude-x"}, "claude-x"),
])
def test_errors_are_anthropic_error_objects_naming_the_field(served, body, needle):
    status, _, reply = call(served, "POST", "/v1/messages", body)
    assert status in (400, 404), reply
    assert reply["type"] == "error" and reply["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert needle in reply["error"]["message"] and "\n" not in reply["error"]["message"]


def test_the_client_raises_the_matching_error_class(served):
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        client(served).messages.create(model="mlx-stream", messages=HELLO, max_tokens=4, extra_body={"stop": ["x"]})
    with pytest.raises(anthropic.NotFoundError):
        client(served).messages.create(model="claude-x", messages=HELLO, max_tokens=4)


def test_the_api_key_may_come_as_x_api_key(tmp_path, plugin_checkpoint):
    import anthropic

    with small_server(tmp_path / "llm", plugin_checkpoint, api_key="sesame") as env:
        with pytest.raises(anthropic.AuthenticationError):
            client(env).messages.create(model="mlx-stream", messages=HELLO, max_tokens=2)
        keyed = anthropic.Anthropic(base_url=env.server.url, api_key="sesame", max_retries=0, timeout=60)
        assert keyed.messages.create(model="mlx-stream", messages=HELLO, max_tokens=2).usage.output_tokens == 2


# -- tools ------------------------------------------------------------------------------

ADD = {"name": "add", "description": "Add two numbers", "input_schema": OPENAI_ADD["function"]["parameters"]}


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_calls_a_tool_and_answers_with_its_result(tooled, stream):
    c = client(tooled)
    tooled.script = [CALL, "It is 5."]
    if stream:
        with c.messages.stream(model="mlx-stream", messages=ASK, tools=[ADD], max_tokens=100) as events:
            kinds = [e.type for e in events]
            reply = events.get_final_message()
        assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    else:
        reply = c.messages.create(model="mlx-stream", messages=ASK, tools=[ADD], max_tokens=100)
    assert reply.stop_reason == "tool_use"
    [call] = reply.content
    assert (call.type, call.name, call.input) == ("tool_use", "add", {"a": 2, "b": 3})

    turn = [{"role": "assistant", "content": reply.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]}]
    answer = c.messages.create(model="mlx-stream", messages=ASK + turn, tools=[ADD], max_tokens=100)
    assert answer.content[0].text == "It is 5." and answer.stop_reason == "end_turn"
    prompt = tooled.tokenizer.decode(tooled.prompts[-1].started.prompt_tokens)
    assert CALL in prompt and "<tool_response>\n5\n</tool_response>" in prompt
    stats = answer.model_extra["mlx_stream"]["stats"]
    assert stats["prefilled_tokens"] < stats["prompt_tokens"] // 2  # the call turn's KV is reused


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "add"}])
def test_a_forced_tool_choice_always_gives_a_valid_call(tooled, choice):
    """Random weights, sampled: constrained decoding alone makes the calls valid (with
    parallel calls allowed, the model may go on calling until max_tokens)."""
    c = client(tooled)
    other = {"name": "shout", "input_schema": {"type": "object", "properties": {
        "word": {"type": "string", "maxLength": 12}}, "required": ["word"], "additionalProperties": False}}
    for seed in range(20):
        reply = c.messages.create(model="mlx-stream", messages=ASK, tools=[other, ADD], tool_choice=choice,
                                  max_tokens=100, extra_body={"temperature": 1.0, "seed": seed})
        calls = [b for b in reply.content if b.type == "tool_use"]
        assert calls, (seed, reply)
        one = choice["type"] == "tool" or choice.get("disable_parallel_tool_use")
        assert not one or (len(calls) == 1 and reply.stop_reason == "tool_use"), (seed, reply)
        for call in calls:
            if choice["type"] == "tool" or call.name == "add":
                assert call.name == "add" and set(call.input) == {"a", "b"}, (seed, call)
                assert all(isinstance(v, int) for v in call.input.values()), (seed, call)


def test_tools_for_a_template_without_tool_support_are_a_400(tooled):
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="no tool support"):
        client(tooled).messages.create(model="mlx-stream/plain", messages=ASK, tools=[ADD], max_tokens=4)


def test_count_tokens_counts_the_tools(tooled):
    c = client(tooled)
    bare = c.messages.count_tokens(model="mlx-stream", messages=ASK).input_tokens
    with_tools = c.messages.count_tokens(model="mlx-stream", messages=ASK, tools=[{**ADD, "strict": True}],
                                         cache_control={"type": "ephemeral"}).input_tokens
    assert with_tools > bare


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_comes_as_a_thinking_block(tooled, stream):
    c = client(tooled)
    tooled.script = ["<think>\nadd them\n</think>\n\nIt is 5."]
    kwargs = dict(model="mlx-stream", messages=ASK, max_tokens=100, thinking={"type": "adaptive"})
    if stream:
        with c.messages.stream(**kwargs) as events:
            reply = events.get_final_message()
    else:
        reply = c.messages.create(**kwargs)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking.strip() == "add them" and reply.content[1].text.strip() == "It is 5."

    budgeted = c.messages.create(model="mlx-stream", messages=ASK, max_tokens=30,
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert budgeted.model_extra["mlx_stream"]["stats"]["generated_tokens"] > 0

    tooled.script = ["It is 5."]
    off = c.messages.create(model="mlx-stream", messages=ASK, max_tokens=100, thinking={"type": "disabled"})
    prompt = tooled.tokenizer.decode(tooled.prompts[-1].started.prompt_tokens)
    assert prompt.endswith("<think>\n\n</think>\n\n") and off.content[0].text == "It is 5."


def test_budget_tokens_closes_the_think_block(tooled, monkeypatch):
    """The model is made to open a think block (its first token), then writes freely: the
    block is closed after budget_tokens tokens of reasoning."""
    import mlx.core as mx

    from llm_mlx_streaming.engine.manager import get_manager

    engine = get_manager()
    scripted_run = engine.run
    [start_id], [end_id] = (tooled.tokenizer.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))

    def run(load, request):
        prompt = len(request.prompt)

        def open_first(tokens, logits):
            if tokens.size != prompt:
                return logits
            return mx.where(mx.arange(logits.shape[-1]) == start_id, mx.zeros_like(logits),
                            mx.full(logits.shape, -mx.inf, dtype=logits.dtype))

        request.logits_processors.append(open_first)
        return scripted_run(load, request)

    monkeypatch.setattr(engine, "run", run)
    reply = client(tooled).messages.create(model="mlx-stream", messages=ASK, max_tokens=40,
                                           thinking={"type": "enabled", "budget_tokens": 5})
    tokens = reply.model_extra["mlx_stream"]["tokens"]
    assert tokens[0] == start_id and end_id in tokens
    assert tokens.index(end_id) == 1 + 5  # five tokens of reasoning, then the end tag
    assert reply.content[0].type == "thinking"


def test_claude_codes_hint_fields_are_accepted_and_named(served):
    """What Claude Code sends beside the conversation: hints the engine cannot use are
    accepted, named once in the x-mlx-stream-ignored header, and change nothing."""
    body = {"model": "mlx-stream", "max_tokens": 8, "stream": False, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hello there",
                                              "cache_control": {"type": "ephemeral"}}]}],
            "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
            "metadata": {"user_id": "u"}, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
            "output_config": {"effort": "high"}, "thinking": {"type": "disabled"}}
    status, headers, reply = call(served, "POST", "/v1/messages?beta=true", body,
                                  headers={"anthropic-beta": "claude-code-20250219,context-management-2025-06-27"})
    assert status == 200, reply
    assert sorted(headers["x-mlx-stream-ignored"].split(", ")) == [
        "context_management", "messages.content.cache_control", "metadata", "output_config.effort",
        "system.cache_control"]
    plain = {"model": "mlx-stream", "max_tokens": 8, "messages": HELLO, "system": "You are terse.",
             "thinking": {"type": "disabled"}}
    assert call(served, "POST", "/v1/messages", plain)[2]["content"] == reply["content"]


def test_thinking_on_a_model_that_cannot_think_is_accepted_as_off(tmp_path, plugin_checkpoint):
    import shutil


    plain = tmp_path / "plain"
    shutil.copytree(plugin_checkpoint, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    with small_server(tmp_path / "llm", plain) as env:
        body = {"model": "mlx-stream", "max_tokens": 4, "messages": HELLO,
                "thinking": {"type": "enabled", "budget_tokens": 100, "display": "omitted"}}
        status, headers, reply = call(env, "POST", "/v1/messages", body)
        assert status == 200, reply
        assert sorted(headers["x-mlx-stream-ignored"].split(", ")) == ["thinking", "thinking.display"]
        assert [b["type"] for b in reply["content"]] == ["text"]
