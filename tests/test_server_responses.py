"""OpenAI's Responses API on `llm mlxs serve`, driven by the official `openai` client (the
API Codex and the openai-agents SDK speak), against a server on a free loopback port."""

from __future__ import annotations

import json
import re

import pytest

from server_support import call, served  # noqa: F401 (served: a fixture)
from test_server_tools import ADD, ASK, CALL, tooled  # noqa: F401 (tooled: a fixture)

ADD_TOOL = {"type": "function", **ADD["function"], "strict": False}


def client(env):
    import openai

    return openai.OpenAI(base_url=env.server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_same_greedy_request_gives_the_same_tokens_through_every_door(served):
    import anthropic
    import ollama

    ask = [{"role": "user", "content": "tell me a story"}]
    responses = client(served).responses.create(model="mlx-stream", input="tell me a story", max_output_tokens=8)
    chat = client(served).chat.completions.create(model="mlx-stream", messages=ask, max_tokens=8)
    messages = anthropic.Anthropic(base_url=served.server.url, api_key="x").messages.create(
        model="mlx-stream", messages=ask, max_tokens=8)
    ollamas = ollama.Client(host=served.server.url).chat(model="mlx-stream", messages=ask, options={"num_predict": 8})
    tokens = responses.model_extra["mlx_stream"]["tokens"]
    assert tokens == chat.model_extra["mlx_stream"]["tokens"] == messages.model_extra["mlx_stream"]["tokens"]
    text = responses.output_text
    assert text == chat.choices[0].message.content == messages.content[0].text == ollamas.message.content
    assert responses.status == "incomplete" and responses.incomplete_details.reason == "max_output_tokens"


@pytest.fixture
def session_cache_only(served):
    """`served` with the conversation cache on disk off: a turn reuses only what the turn
    before it left in the KV cache (not a longer prefix another API's turn saved)."""
    settings = served.read_settings()
    served.write_settings(**settings, conversation_cache=False)
    yield served
    served.write_settings(**settings)


def test_cached_tokens_are_the_same_number_through_every_door(session_cache_only):
    """One two-turn conversation through each API (turn 2 extends turn 1): each reports the
    prompt tokens turn 2 took from the KV cache in its own field, the engine's one figure."""
    import anthropic

    env = session_cache_only
    c, claude = client(env), anthropic.Anthropic(base_url=env.server.url, api_key="x", max_retries=0)
    one = [{"role": "user", "content": "one"}]
    first = c.chat.completions.create(model="mlx-stream", messages=one, max_tokens=6)
    two = [*one, {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "two"}]

    def chat(messages):
        reply = c.chat.completions.create(model="mlx-stream", messages=messages, max_tokens=6)
        cached = reply.usage.prompt_tokens_details.cached_tokens  # the openai client's own type
        assert cached == reply.model_extra["mlx_stream"]["stats"]["reused_tokens"]
        return cached

    def chat_streamed(messages):
        chunks = list(c.chat.completions.create(model="mlx-stream", messages=messages, max_tokens=6, stream=True,
                                                stream_options={"include_usage": True}))
        return chunks[-1].usage.prompt_tokens_details.cached_tokens

    def responses(messages):
        reply = c.responses.create(model="mlx-stream", input=messages, max_output_tokens=6)
        return reply.usage.input_tokens_details.cached_tokens

    def messages_api(messages):
        return claude.messages.create(model="mlx-stream", messages=messages, max_tokens=6).usage.cache_read_input_tokens

    def ollama(messages):
        body = {"model": "mlx-stream", "messages": messages, "stream": False, "options": {"num_predict": 6}}
        return call(env, "POST", "/api/chat", body)[2]["prompt_eval_cached_count"]

    cached = {}
    for ask in (chat, chat_streamed, responses, messages_api, ollama):
        ask(one)
        cached[ask.__name__] = ask(two)
    assert set(cached.values()) == {cached["chat"]}, cached
    assert cached["chat"] >= first.usage.prompt_tokens + 5  # turn 1's prompt and its reply


def test_a_text_completion_reports_its_cached_tokens_whole_and_streamed(session_cache_only):
    c = client(session_cache_only)
    first = c.completions.create(model="mlx-stream", prompt="one two three", max_tokens=6)
    more = "one two three" + first.choices[0].text + " four"
    whole = c.completions.create(model="mlx-stream", prompt=more, max_tokens=6)
    c.completions.create(model="mlx-stream", prompt="one two three", max_tokens=6)
    chunks = list(c.completions.create(model="mlx-stream", prompt=more, max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}))
    cached = whole.usage.prompt_tokens_details.cached_tokens
    assert cached == whole.model_extra["mlx_stream"]["stats"]["reused_tokens"] >= first.usage.prompt_tokens - 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_a_streamed_response_is_the_event_sequence_the_client_parses(served):
    with client(served).responses.stream(model="mlx-stream", input="tell me a story", max_output_tokens=8) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    whole = client(served).responses.create(model="mlx-stream", input="tell me a story", max_output_tokens=8)
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert final.output_text == whole.output_text and final.usage.output_tokens == 8


def test_created_at_is_whole_seconds_and_a_cut_message_is_incomplete_as_its_response(served):
    """OpenAI sends created_at as an integer; the message the token limit ended says
    `incomplete`, as the response does, whole and streamed."""
    whole = call(served, "POST", "/v1/responses", {"model": "mlx-stream", "input": "tell me a story",
                                                   "max_output_tokens": 4})[2]
    with client(served).responses.stream(model="mlx-stream", input="tell me a story", max_output_tokens=4) as s:
        done = [e.item.status for e in s if e.type == "response.output_item.done"]
        streamed = s.get_final_response()
    assert type(whole["created_at"]) is int and type(whole["completed_at"]) is int
    assert whole["status"] == streamed.status == "incomplete"
    assert [item["status"] for item in whole["output"]] == ["incomplete"]
    assert done == [item.status for item in streamed.output] == ["incomplete"]


def test_previous_response_id_continues_on_the_kv_cache_and_is_kept_per_id(served):
    first = client(served).responses.create(model="mlx-stream", input="hello there", max_output_tokens=6)
    second = client(served).responses.create(model="mlx-stream", input="and then?", max_output_tokens=6,
                                             previous_response_id=first.id)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + 6 - 1
    assert client(served).responses.retrieve(first.id).output_text == first.output_text
    client(served).responses.delete(first.id)
    status, _, reply = call(served, "GET", f"/v1/responses/{first.id}")
    assert status == 404 and reply["error"]["code"] == "response_not_found", reply


def test_an_evicted_previous_response_is_a_404_in_openais_shape_never_a_500(served):
    first = client(served).responses.create(model="mlx-stream", input="hello there", max_output_tokens=1)
    for i in range(100):  # the default max_responses: the first is now the 101st
        client(served).responses.create(model="mlx-stream", input=f"n {i}", max_output_tokens=1)
    status, _, reply = call(served, "POST", "/v1/responses", {"model": "mlx-stream", "input": "more",
                                                              "previous_response_id": first.id})
    assert status == 404 and reply["error"]["param"] == "previous_response_id", reply
    unkept = client(served).responses.create(model="mlx-stream", input="x", max_output_tokens=1, store=False)
    assert call(served, "GET", f"/v1/responses/{unkept.id}")[0] == 404
    assert call(served, "GET", "/api/stats")[2]["caches"]["responses"] == {"entries": 100, "max_entries": 100}


def test_a_function_call_round_trip_with_namespaced_and_hosted_tools(tooled):
    tools = [ADD_TOOL, {"type": "namespace", "name": "math", "tools": [{**ADD_TOOL, "name": "mul"}]},
             {"type": "web_search", "external_web_access": False}]
    tooled.script = [CALL.replace('"add"', '"mul"')]
    status, headers, reply = call(tooled, "POST", "/v1/responses", {
        "model": "mlx-stream", "input": ASK[0]["content"], "tools": tools, "max_output_tokens": 100,
        "store": False, "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"}})
    assert status == 200, reply
    assert "tools.web_search" in headers["x-mlx-stream-ignored"].split(", ")
    (made,) = [o for o in reply["output"] if o["type"] == "function_call"]
    assert made["name"] == "mul" and made["namespace"] == "math" and json.loads(made["arguments"]) == {"a": 2, "b": 3}
    tooled.script = ["It is 6."]
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK[0]["content"]}]},
             {k: made[k] for k in ("type", "call_id", "name", "arguments", "namespace")},
             {"type": "function_call_output", "call_id": made["call_id"], "output": "6"}]
    second = client(tooled).responses.create(model="mlx-stream", input=items, tools=tools, max_output_tokens=100)
    assert second.output_text.strip() == "It is 6."
    assert second.usage.input_tokens_details.cached_tokens > 0  # the call was kept as generated


@pytest.mark.parametrize("syntax,definition,pattern", [
    ("lark", 'start: "ok " NUMBER\nNUMBER: /[0-9]{1,3}/', r"ok [0-9]{1,3}"),
    ("regex", r"(yes|no) [a-z]{2,5}", r"(yes|no) [a-z]{2,5}"),
])
def test_a_forced_custom_tool_follows_its_grammar_for_every_seed(served, syntax, definition, pattern):
    tool = {"type": "custom", "name": "verdict", "format": {"type": "grammar", "syntax": syntax,
                                                           "definition": definition}}
    for seed in range(20):
        reply = client(served).responses.create(
            model="mlx-stream", input="decide", tools=[tool], tool_choice={"type": "custom", "name": "verdict"},
            temperature=1.0, max_output_tokens=12, extra_body={"seed": seed})
        (made,) = reply.output
        assert made.type == "custom_tool_call" and made.name == "verdict"
        assert re.fullmatch(pattern, made.input), (seed, made.input)


@pytest.mark.parametrize("body,needle", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "takes no images"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0"),
    ({"input": "hi", "max_tokens": 4}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tool_choice": {"type": "custom", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "resp_nope"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "[1]"}]}, "input.0.arguments"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "schema"),
])
def test_what_cannot_be_honoured_is_an_openai_error_naming_it(served, body, needle):
    status, _, reply = call(served, "POST", "/v1/responses", {"model": "mlx-stream", **body})
    assert status in (400, 404), reply
    assert needle in reply["error"]["message"] and "\n" not in reply["error"]["message"], reply
