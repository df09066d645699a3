"""Ollama's API of `llm mlxs serve`, driven by the official `ollama` client against a
server on a free loopback port (stopped at the end)."""

from __future__ import annotations

import json
import time

import pytest

from server_support import call, in_process, send, served, small_server, wait_for  # noqa: F401 (served: a fixture)
from test_server_tools import ADD, ASK, CALL, tooled  # noqa: F401 (tooled: a fixture)

HELLO = [{"role": "user", "content": "hello there"}]
CURL = {"User-Agent": "curl/8.5.0", "Accept": "*/*"}
# The headers of litellm 1.110.2's ollama_chat/ and ollama/ providers, recorded from a real
# run: their bodies carry no Content-Type (only its /api/show sends application/json).
LITELLM = {"User-Agent": "litellm/1.110.2", "Accept": "*/*", "Accept-Encoding": "gzip, deflate",
           "Connection": "keep-alive"}


def client(served, **kwargs):
    import ollama

    return ollama.Client(host=served.server.url, timeout=60, **kwargs)


def figures(env, **body) -> dict:
    """The engine's figures of one /api/chat (the client keeps no extension fields)."""
    status, _, reply = call(env, "POST", "/api/chat", {"model": "mlx-stream", "stream": False, **body})
    assert status == 200, reply
    return reply["mlx_stream"]["stats"]


def test_chat_and_generate_equal_the_in_process_greedy_reply(served):
    expected = in_process([{"role": "system", "content": "be brief"}, *HELLO], max_tokens=10)
    c = client(served)
    messages = [{"role": "system", "content": "be brief"}, *HELLO]
    reply = c.chat(model="sm", messages=messages, options={"num_predict": 10})
    assert reply.message.content == expected and reply.done and reply.done_reason == "length"
    assert reply.eval_count == 10 and reply.prompt_eval_count > 0 and reply.model == "sm"

    pieces = list(c.chat(model="mlx-stream", messages=messages, options={"num_predict": 10}, stream=True))
    assert "".join(p.message.content for p in pieces) == expected
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert pieces[-1].done_reason == "length" and pieces[-1].eval_count == 10

    generated = c.generate(model="mlx-stream", system="be brief", prompt="hello there", options={"num_predict": 10})
    assert generated.response == expected
    streamed = "".join(p.response for p in c.generate(model="mlx-stream", system="be brief", prompt="hello there",
                                                      options={"num_predict": 10}, stream=True))
    assert streamed == expected
    raw = c.generate(model="mlx-stream", prompt="abc def", raw=True, options={"num_predict": 4})
    assert raw.prompt_eval_count < 8  # no chat template


def test_options_map_onto_the_engine(served):
    c = client(served)
    full = c.chat(model="mlx-stream", messages=HELLO, options={"num_predict": 12}).message.content
    stop = full[4:7]
    cut = c.chat(model="mlx-stream", messages=HELLO, options={"num_predict": 12, "stop": [stop]})
    assert cut.message.content == full[: full.index(stop)] and cut.done_reason == "stop"

    sampled = {"temperature": 1.0, "seed": 3, "top_k": 20, "top_p": 0.9, "repeat_penalty": 1.2, "num_predict": 8}
    first = c.chat(model="mlx-stream", messages=[{"role": "user", "content": "hi"}], options=sampled)
    c.generate(model="mlx-stream", prompt="something else", options={"num_predict": 3})
    again = c.chat(model="mlx-stream", messages=[{"role": "user", "content": "hi"}], options=sampled)
    assert first.message.content == again.message.content
    assert figures(served, messages=HELLO, options={"num_predict": 2, "expert_slots": 2})["expert_slots"] == 2

    schema = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
    shaped = c.chat(model="mlx-stream", messages=HELLO, format=schema, options={"num_predict": 40})
    assert set(json.loads(shaped.message.content)) == {"word"}
    assert isinstance(json.loads(c.generate(model="mlx-stream", prompt="hi", format="json",
                                            options={"num_predict": 40}).response), dict)


def test_num_ctx_is_the_context_of_this_request(served):
    import ollama

    c = client(served)
    capped = c.chat(model="mlx-stream", messages=HELLO, options={"num_ctx": 40, "num_predict": -1})
    assert capped.prompt_eval_count + capped.eval_count == 40 and capped.done_reason == "length"
    with pytest.raises(ollama.ResponseError, match="longer than the max_context of 12 tokens"):
        c.chat(model="mlx-stream", messages=HELLO, options={"num_ctx": 12})


def test_logprobs(served):
    c = client(served)
    reply = c.chat(model="mlx-stream", messages=HELLO, logprobs=True, top_logprobs=2, options={"num_predict": 4})
    assert len(reply.logprobs) == 4 and "".join(e.token for e in reply.logprobs).strip() == reply.message.content.strip()
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in reply.logprobs)
    last = list(c.generate(model="mlx-stream", prompt="hi", logprobs=True, stream=True, options={"num_predict": 3}))
    assert len(last[-1].logprobs) == 3


def test_a_follow_up_reuses_the_kv_cache(served):
    c = client(served)
    first = c.chat(model="mlx-stream", messages=[{"role": "user", "content": "one"}], options={"num_predict": 6})
    follow = figures(served, options={"num_predict": 6}, messages=[
        {"role": "user", "content": "one"}, {"role": "assistant", "content": first.message.content},
        {"role": "user", "content": "two"}])
    assert follow["reused_tokens"] >= first.prompt_eval_count + 5


def ndjson(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.splitlines()]


@pytest.mark.parametrize("label", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_ollamas_documented_curl_requests_are_answered_however_the_body_is_labelled(served, label):
    """Ollama's docs post with `curl -d` (the form type) or send no Content-Type: a body is
    JSON because it parses, and a request without `stream` streams NDJSON."""
    headers = {**CURL, **({"Content-Type": label} if label else {})}
    options = {"num_predict": 4}
    expected = client(served).chat(model="mlx-stream", messages=HELLO, options=options).message.content

    def post(path: str, body: dict) -> tuple[int, dict, bytes]:
        return send(served, "POST", path, json.dumps({"model": "mlx-stream", "options": options, **body}).encode(),
                    headers)

    status, _, whole = post("/api/chat", {"messages": HELLO, "stream": False})
    assert status == 200 and json.loads(whole)["message"]["content"] == expected, whole
    status, head, streamed = post("/api/chat", {"messages": HELLO})
    lines = ndjson(streamed)
    assert status == 200 and head["content-type"].startswith("application/x-ndjson")
    assert "".join(line["message"]["content"] for line in lines) == expected and lines[-1]["done"]
    status, _, generated = post("/api/generate", {"prompt": "hello there"})
    assert status == 200 and ndjson(generated)[-1]["done"] and len(ndjson(generated)) > 1
    status, _, shown = post("/api/show", {})
    assert status == 200 and "completion" in json.loads(shown)["capabilities"]
    status, _, tags = send(served, "GET", "/api/tags", headers=CURL)
    assert status == 200 and json.loads(tags)["models"]


@pytest.mark.parametrize("stream", [False, True])
def test_litellms_ollama_requests_are_answered_whole_and_streamed(served, stream):
    """The requests litellm's ollama_chat/ (/api/chat) and ollama/ (/api/generate) providers
    send, byte for byte, and the /api/show with Ollama's older `name` they ask first."""
    labelled = {**LITELLM, "Content-Type": "application/json"}
    status, _, shown = send(served, "POST", "/api/show", b'{"name":"sm"}', labelled)
    assert status == 200 and "completion" in json.loads(shown)["capabilities"], shown
    prompt = "### User:\nhello there\n\n"
    c = client(served)
    chat = {"model": "sm", "messages": [{"role": "user", "content": "hello there", "images": []}],
            "options": {"num_predict": 8}, "stream": stream}
    generate = {"model": "sm", "prompt": prompt, "options": {"num_predict": 8}, "stream": stream, "images": []}
    requests = [("/api/chat", chat, lambda line: line["message"]["content"],
                 c.chat(model="sm", messages=HELLO, options={"num_predict": 8}).message.content),
                ("/api/generate", generate, lambda line: line["response"],
                 c.generate(model="sm", prompt=prompt, options={"num_predict": 8}).response)]
    for path, body, text, expected in requests:
        status, head, reply = send(served, "POST", path, json.dumps(body).encode(), LITELLM)
        lines = ndjson(reply)
        assert status == 200, reply
        assert head["content-type"].startswith("application/x-ndjson" if stream else "application/json")
        assert (len(lines) > 1) == stream and lines[-1]["done"] and lines[-1]["eval_count"] == 8
        assert "".join(text(line) for line in lines) == expected


@pytest.mark.parametrize("body,needle", [
    ({"messages": HELLO, "options": {"mirostat": 2}}, "mirostat"),
    ({"messages": HELLO, "options": {"repeat_penalty": 0.5}}, "options.repeat_penalty"),
    ({"messages": HELLO, "options": {"num_ctx": 0}}, "options.num_ctx"),
    ({"messages": HELLO, "options": {"num_ctx": 8192}}, "max_context 8192 is above the 96 tokens the KV cache is planned for"),
    ({"messages": HELLO, "options": {"max_tokens": 3}}, "max_tokens: this API's field is options.num_predict"),
    ({"messages": HELLO, "keep_alive": "a while"}, "keep_alive"),
    ({"messages": HELLO, "think": "extreme"}, "think"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "mlx-stream takes no images: it is a text-only model"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages.0"),
    ({"messages": HELLO, "model": "llama3"}, "llama3"),
])
def test_errors_are_ollama_error_objects_naming_the_field(served, body, needle):
    status, _, reply = call(served, "POST", "/api/chat", {"model": "mlx-stream", "stream": False, **body})
    assert status in (400, 404), reply
    assert set(reply) == {"error"} and needle in reply["error"] and "\n" not in reply["error"], reply


@pytest.mark.parametrize("path", ["/api/pull", "/api/push", "/api/create", "/api/copy", "/api/embed",
                                  "/api/embeddings", "/api/delete"])
def test_what_does_not_map_is_a_clear_error(served, path):
    status, _, reply = call(served, "POST", path, {"model": "x"})
    assert status == 400 and "not served" in reply["error"]


def test_models_show_ps_version_and_unloading(served):
    import ollama

    c = client(served)
    names = {m.model for m in c.list().models}
    assert {"mlx-stream:latest", "mlx-stream/small:latest"} <= names  # Ollama's names carry its default tag
    small = next(m for m in c.list().models if m.model == "mlx-stream/small:latest")
    assert small.size > 0 and small.details.family == "qwen3_moe"
    assert small.details.quantization_level == "F32" and small.details.parameter_size.endswith("K")
    shown = c.show("sm")
    assert shown.details.family == "qwen3_moe" and "completion" in shown.capabilities
    version = tuple(int(n) for n in call(served, "GET", "/api/version")[2]["version"].split("."))
    assert version >= (0, 6, 4)  # what clients that check it want (VS Code's Copilot: 0.6.4)

    c.chat(model="mlx-stream", messages=HELLO, options={"num_predict": 2})
    assert [m.model for m in c.ps().models] == ["mlx-stream:latest"]
    unloaded = c.chat(model="mlx-stream", messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload" and c.ps().models == []
    loaded = c.generate(model="mlx-stream")
    assert loaded.done_reason == "load" and [m.model for m in c.ps().models] == ["mlx-stream:latest"]
    after = c.chat(model="mlx-stream", messages=HELLO, options={"num_predict": 2}, keep_alive=0)
    assert after.message.content and c.ps().models == []
    streamed = list(c.chat(model="mlx-stream", messages=HELLO, options={"num_predict": 2}, keep_alive=0, stream=True))
    assert streamed[-1].done_reason == "length"
    wait_for(lambda: c.ps().models == [])  # unloaded once the stream gave back its turn

    c.generate(model="mlx-stream", keep_alive="1h")
    [listed] = c.ps().models
    assert listed.model == "mlx-stream:latest"
    assert 3500 < listed.expires_at.timestamp() - time.time() <= 3600
    c.chat(model="mlx-stream", messages=HELLO, options={"num_predict": 2})  # the server's keep_alive: until told
    assert [m["expires_at"][:4] for m in call(served, "GET", "/api/ps")[2]["models"]] == ["9999"]
    c.chat(model="mlx-stream", messages=HELLO, options={"num_predict": 2}, keep_alive=0.05)
    wait_for(lambda: c.ps().models == [])  # unloaded when its keep_alive ran out
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("llama3")
    assert e.value.status_code == 400


def test_every_route_takes_a_name_with_ollamas_latest_tag(served):
    """Ollama's clients add `:latest`: `name` and `name:latest` are one model on each route."""
    c = client(served)
    expected = c.chat(model="sm", messages=HELLO, options={"num_predict": 4}).message.content
    for name in ("sm:latest", "mlx-stream/small:latest", "mlx-stream:latest"):
        reply = c.chat(model=name, messages=HELLO, options={"num_predict": 4})
        assert reply.message.content == expected and reply.model == name
        streamed = "".join(p.message.content for p in c.chat(model=name, messages=HELLO, stream=True,
                                                              options={"num_predict": 4}))
        assert streamed == expected
        assert c.generate(model=name, prompt="hello", options={"num_predict": 2}).done
        assert c.show(name).details.family == "qwen3_moe"
    assert c.chat(model="mlx-stream:latest", messages=[], keep_alive=0).done_reason == "unload"
    assert c.ps().models == []
    assert c.generate(model="mlx-stream:latest").done_reason == "load"
    assert [m.model for m in c.ps().models] == ["mlx-stream:latest"]
    import ollama

    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="nothing:latest", messages=HELLO)
    assert e.value.status_code == 404


def test_unloading_needs_the_api_key_when_one_is_set(tmp_path, plugin_checkpoint):
    import ollama

    with small_server(tmp_path / "llm", plugin_checkpoint, api_key="sesame") as env:
        with pytest.raises(ollama.ResponseError) as e:
            client(env).chat(model="mlx-stream", messages=[], keep_alive=0)
        assert e.value.status_code == 401
        keyed = client(env, headers={"Authorization": "Bearer sesame"})
        assert keyed.chat(model="mlx-stream", messages=[], keep_alive=0).done_reason == "unload"


# -- tools ------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_calls_a_tool_and_answers_with_its_result(tooled, stream):
    c = client(tooled)
    tooled.script = [CALL, "It is 5."]
    if stream:
        parts = list(c.chat(model="mlx-stream", messages=ASK, tools=[ADD], stream=True, options={"num_predict": 100}))
        calls = [t for p in parts for t in p.message.tool_calls or []]
        content = "".join(p.message.content or "" for p in parts)
    else:
        reply = c.chat(model="mlx-stream", messages=ASK, tools=[ADD], options={"num_predict": 100})
        calls, content = reply.message.tool_calls, reply.message.content
    assert content == ""
    [call_] = calls
    assert (call_.function.name, dict(call_.function.arguments)) == ("add", {"a": 2, "b": 3})

    turn = [{"role": "assistant", "content": "", "tool_calls": [call_]},
            {"role": "tool", "content": "5", "tool_name": "add"}]
    answer = c.chat(model="mlx-stream", messages=ASK + turn, tools=[ADD], options={"num_predict": 100})
    assert answer.message.content == "It is 5." and answer.done_reason == "stop"
    prompt = tooled.tokenizer.decode(tooled.prompts[-1].started.prompt_tokens)
    assert CALL in prompt and "<tool_response>\n5\n</tool_response>" in prompt
    stats = tooled.prompts[-1].stats
    assert stats["prefilled_tokens"] < stats["prompt_tokens"] // 2  # the call turn's KV is reused


def test_tools_for_a_template_without_tool_support_are_a_400(tooled):
    import ollama

    with pytest.raises(ollama.ResponseError, match="no tool support") as e:
        client(tooled).chat(model="mlx-stream/plain", messages=ASK, tools=[ADD])
    assert e.value.status_code == 400


def test_reasoning_comes_as_thinking(tooled):
    c = client(tooled)
    tooled.script = ["<think>\nadd them\n</think>\n\nIt is 5."]
    reply = c.chat(model="mlx-stream", messages=ASK, think=True, options={"num_predict": 100})
    assert reply.message.thinking.strip() == "add them" and reply.message.content.strip() == "It is 5."
    tooled.script = ["<think>\nadd them\n</think>\n\nIt is 5."]
    parts = list(c.generate(model="mlx-stream", prompt="What is 2 + 3?", think=True, stream=True,
                            options={"num_predict": 100}))
    assert "".join(p.thinking or "" for p in parts).strip() == "add them"
    assert "".join(p.response for p in parts).strip() == "It is 5."


@pytest.mark.parametrize("status,kind", [(401, "authentication_error"), (404, "not_found_error"),
                                         (503, "overloaded_error"), (500, "api_error")])
def test_an_error_has_the_shape_of_each_api(status, kind):
    from llm_mlx_streaming.server.anthropic.shapes import error_body as anthropic_error
    from llm_mlx_streaming.server.errors import ApiError
    from llm_mlx_streaming.server.ollama.shapes import error_body as ollama_error

    error = ApiError(status, "no\nway", code="c")
    assert anthropic_error(error) == {"type": "error", "error": {"type": kind, "message": "no way"}}
    assert ollama_error(error) == {"error": "no way"}
    assert error.openai_body()["error"]["code"] == "c"  # the server's own: OpenAI's
