"""`llm mlxs serve`: a real server on a free loopback port, driven by the official
openai client, by llm's CLI, by several clients at once and by schemathesis.

One server (in a thread of this process, stopped at the end) serves most tests; the
engine is the process-wide one, so the tests also check it directly (pool verify).
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import threading
import urllib.request

import pytest

from plugin_support import LlmEnv, assert_ok, assert_one_line_error
from server_support import call, in_process, send, served, wait_for  # noqa: F401 (served: a fixture)

PROMPTS = ["hello there", "tell me a story", "what is a disk", "name three colours"]


def client(served):
    import openai

    return openai.OpenAI(base_url=served.server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def raw_status(served, rest: bytes) -> int:
    """The status of a POST whose headers end with `rest` (a server may answer and
    close before the whole body is sent)."""
    sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=30)
    try:
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + rest)
        except OSError:
            pass
        head = sock.recv(4096)
    finally:
        sock.close()
    return int(head.split()[1])


def chat_body(prompt, **extra):
    return {"model": "mlx-stream", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, **extra}


@pytest.fixture
def blocked(monkeypatch):
    """Hold the next prompt inside its rendering until `go` is set, so
    requests queue behind it deterministically (released at teardown whatever happens)."""
    hold = Blocked(monkeypatch)
    yield hold
    hold.go.set()


class Blocked:
    def __init__(self, monkeypatch):
        from llm_mlx_streaming.reply import build as prompting  # where the reply core calls render_prompt

        self.entered, self.go = threading.Event(), threading.Event()
        real = prompting.render_prompt

        def render(tokenizer, prompt, **kwargs):
            if not self.go.is_set():
                self.entered.set()
                assert self.go.wait(60)
            return real(tokenizer, prompt, **kwargs)

        monkeypatch.setattr(prompting, "render_prompt", render)


def in_thread(fn, *args):
    out = {}

    def work():
        try:
            out["value"] = fn(*args)
        except Exception as e:  # pragma: no cover - reported by the caller
            out["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    return t, out


# -- the OpenAI API ------------------------------------------------------------------


def test_a_server_request_never_goes_through_llms_models(served, monkeypatch):
    """Every API's route drives the reply core itself: llm's model registry is never asked."""
    import llm

    def refuse(*args, **kwargs):
        raise AssertionError("the server looked a model up through llm")

    for name in ("get_model", "get_async_model", "get_models_with_aliases"):
        monkeypatch.setattr(llm, name, refuse)
    ask = [{"role": "user", "content": "hello there"}]
    streamed = urllib.request.Request(served.server.url + "/v1/chat/completions", method="POST",
                                      data=json.dumps(chat_body("hello there", stream=True)).encode(),
                                      headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(streamed, timeout=60) as resp:
        assert resp.read().endswith(b"data: [DONE]\n\n")
    for path, body in (("/v1/chat/completions", chat_body("hello there")),
                       ("/v1/completions", {"model": "mlx-stream", "prompt": "hello", "max_tokens": 4}),
                       ("/v1/messages", {"model": "mlx-stream", "max_tokens": 4, "messages": ask}),
                       ("/v1/messages/count_tokens", {"model": "mlx-stream", "messages": ask}),
                       ("/api/chat", {"model": "mlx-stream", "messages": ask, "stream": False,
                                      "options": {"num_predict": 4}})):
        status, _, reply = call(served, "POST", path, body)
        assert status == 200, (path, reply)
    assert call(served, "GET", "/v1/models")[0] == 200


def test_openai_client_matches_in_process_greedy(served):
    c = client(served)
    ids = [m.id for m in c.models.list().data]
    assert {"mlx-stream", "mlx-stream/small", "mlx-stream/tiny-moe"} <= set(ids)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    expected = in_process(messages, max_tokens=10)
    assert expected

    reply = c.chat.completions.create(model="sm", messages=messages, max_tokens=10)
    assert reply.choices[0].message.content == expected
    assert reply.model == "mlx-stream/small"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 10 and reply.usage.prompt_tokens > 0

    pieces, usage, finish = [], None, None
    for chunk in c.chat.completions.create(model="mlx-stream", messages=messages, max_tokens=10, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == expected
    assert finish == "length" and usage.completion_tokens == 10


def test_completions_stop_seed_and_kv_reuse(served):
    c = client(served)
    text = c.completions.create(model="mlx-stream", prompt="abc def", max_tokens=6)
    assert text.choices[0].text and text.usage.prompt_tokens < 8  # raw text: no chat template

    full = c.chat.completions.create(model="mlx-stream", messages=[{"role": "user", "content": "hello there"}],
                                     max_tokens=12).choices[0].message.content
    stop = full[4:7]
    cut = c.chat.completions.create(model="mlx-stream", messages=[{"role": "user", "content": "hello there"}],
                                    max_tokens=12, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"

    sampled = [c.chat.completions.create(model="mlx-stream", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=8, temperature=1.0, seed=3).choices[0].message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]

    # a follow-up that extends the previous conversation prefills only its new tokens
    first = c.chat.completions.create(model="mlx-stream", messages=[{"role": "user", "content": "one"}], max_tokens=6)
    follow = c.chat.completions.create(model="mlx-stream", max_tokens=6, messages=[
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "two"}])
    stats = follow.model_extra["mlx_stream"]["stats"]
    assert stats["reused_tokens"] >= first.usage.prompt_tokens + 5


def test_engine_options_are_body_fields_derived_from_the_plugin_options(served):
    from llm_mlx_streaming.options.settings import Options
    from llm_mlx_streaming.server.fields import SERVER_ONLY

    status, _, schema = call(served, "GET", "/openapi.json")
    assert status == 200
    fields = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in Options.model_fields:
        assert (name in fields) == (name not in SERVER_ONLY), name
    status, _, config = call(served, "GET", "/api/engine/config")
    assert set(Options.model_fields) - set(SERVER_ONLY) <= set(config)

    status, _, body = call(served, "POST", "/v1/chat/completions", chat_body("hi", expert_slots=2, policy="lru"))
    assert status == 200, body
    assert body["mlx_stream"]["stats"]["expert_slots"] == 2 and body["mlx_stream"]["stats"]["policy"] == "lru"
    status, _, body = call(served, "POST", "/v1/chat/completions", chat_body("hi", expert_slots=0))
    assert status == 400 and body["error"]["param"] == "expert_slots", body


# -- the runtime API -----------------------------------------------------------------


def test_stats_and_config_validation(served):
    call(served, "POST", "/v1/chat/completions", chat_body("hi"))
    status, _, stats = call(served, "GET", "/api/stats")
    assert status == 200 and stats["state"] == "loaded" and stats["model"] == "mlx-stream"
    assert stats["rebuilding"] is False and stats["server"]["queued"] == 0
    assert stats["last_decode_tps"] > 0 and stats["peak_rss_bytes"] > 0
    layers = stats["layers"]  # the current pools; the totals also count pools replaced by rebuilds
    assert len(layers) == 2 and 0 < sum(layer["hits"] + layer["misses"] for layer in layers) <= stats["hits"] + stats["misses"]
    assert all(layer["slots"] == 4 and "hit_rate" in layer for layer in layers)

    before = call(served, "GET", "/api/engine/config")[2]
    for bad in ({"expert_slots": 0}, {"policy": "nope"}, {"no_such_knob": 1}, {"memory_budget": "1KB"}):
        status, _, body = call(served, "POST", "/api/engine/config", bad)
        assert status == 422, (bad, body)
        assert "\n" not in body["error"]["message"]
    assert call(served, "GET", "/api/engine/config")[2] == before

    status, _, config = call(served, "POST", "/api/engine/config", {"max_tokens": 3})
    assert status == 200 and config["max_tokens"] == 3
    body = call(served, "POST", "/v1/chat/completions",
                {"model": "mlx-stream", "messages": [{"role": "user", "content": "hi"}]})[2]
    assert body["usage"]["completion_tokens"] == 3
    assert call(served, "POST", "/api/engine/config", {"max_tokens": None})[2]["max_tokens"] == 256


def test_stats_answer_while_a_pool_is_being_replaced(served, monkeypatch):
    from llm_mlx_streaming.engine.manager import get_manager

    call(served, "POST", "/v1/chat/completions", chat_body("hi"))
    layer = get_manager().loaded.layers[0]
    monkeypatch.setattr(layer, "pool", None)  # what a rebuild leaves for a moment
    status, _, stats = call(served, "GET", "/api/stats")
    assert status == 200 and [layer["layer"] for layer in stats["layers"]] == [1]


def test_config_change_while_requests_queue_rebuilds_before_they_run(served, blocked):
    from llm_mlx_streaming.engine.manager import get_manager

    blocked.go.set()
    call(served, "POST", "/v1/chat/completions", chat_body("warm"))  # loaded, 4 slots
    blocked.go.clear()
    first, first_out = in_thread(call, served, "POST", "/v1/chat/completions", chat_body("first"))
    assert blocked.entered.wait(30)
    queued, queued_out = in_thread(call, served, "POST", "/v1/chat/completions", chat_body("queued"))
    wait_for(lambda: call(served, "GET", "/api/stats")[2]["server"]["queued"] == 1)
    status, _, config = call(served, "POST", "/api/engine/config", {"expert_slots": 2})
    assert status == 200 and config["rebuilding"] is True
    assert call(served, "GET", "/api/stats")[2]["rebuilding"] is True
    blocked.go.set()
    for t in (first, queued):
        t.join(60)
    assert first_out["value"][2]["mlx_stream"]["stats"]["expert_slots"] == 4
    assert queued_out["value"][2]["mlx_stream"]["stats"]["expert_slots"] == 2
    wait_for(lambda: not call(served, "GET", "/api/stats")[2]["rebuilding"])
    assert get_manager().running.slots_per_layer() == 2 and get_manager().bad_slots() == 0
    call(served, "POST", "/api/engine/config", {"expert_slots": None})


# -- one at a time, queue bound, disconnects -------------------------------------------


def test_four_clients_at_once_are_served_one_at_a_time_as_alone(served, blocked):
    c = client(served)

    def ask(prompt):
        return c.chat.completions.create(model="mlx-stream", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=8).choices[0].message.content

    blocked.go.set()
    alone = {p: ask(p) for p in PROMPTS}
    served_before = call(served, "GET", "/api/stats")[2]["server"]["served"]
    blocked.go.clear()
    runs = [in_thread(ask, p) for p in PROMPTS]
    assert blocked.entered.wait(30)
    # one runs (held inside the engine), the other three wait their turn
    wait_for(lambda: call(served, "GET", "/api/stats")[2]["server"]["queued"] == 3)
    assert call(served, "GET", "/api/stats")[2]["server"]["running"] is True
    blocked.go.set()
    for t, _ in runs:
        t.join(120)
    assert [out.get("value") for _, out in runs] == [alone[p] for p in PROMPTS]
    assert call(served, "GET", "/api/stats")[2]["server"]["served"] == served_before + 4


def test_full_queue_is_503_with_retry_after(tmp_path, monkeypatch, plugin_checkpoint, blocked):
    from llm_mlx_streaming.server.process.run import Server

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    env = LlmEnv(tmp_path / "llm", plugin_checkpoint)
    env.write_settings(default_model="small", max_batch=1, models={"small": {"path": str(plugin_checkpoint), "expert_slots": 4}})
    with Server(port=0, max_queue=1) as server:
        env.server = server
        running, _ = in_thread(call, env, "POST", "/v1/chat/completions", chat_body("a"))
        assert blocked.entered.wait(30)
        waiting, waiting_out = in_thread(call, env, "POST", "/v1/chat/completions", chat_body("b"))
        wait_for(lambda: call(env, "GET", "/api/stats")[2]["server"]["queued"] == 1)
        status, headers, body = call(env, "POST", "/v1/chat/completions", chat_body("c"))
        assert status == 503 and headers["Retry-After"] and body["error"]["code"] == "queue_full"
        blocked.go.set()
        running.join(60)
        waiting.join(60)
        assert waiting_out["value"][0] == 200


def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once(served, blocked):
    blocked.go.set()
    call(served, "POST", "/v1/chat/completions", chat_body("warm"))
    blocked.go.clear()
    running, running_out = in_thread(call, served, "POST", "/v1/chat/completions", chat_body("first"))
    assert blocked.entered.wait(30)
    gone_before = call(served, "GET", "/api/stats")[2]["server"]["disconnects"]
    sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=30)
    body = json.dumps(chat_body("never mind")).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: call(served, "GET", "/api/stats")[2]["server"]["queued"] == 1)
    sock.close()
    # still blocked: the place is given up while the running request holds the engine
    wait_for(lambda: call(served, "GET", "/api/stats")[2]["server"]["queued"] == 0)
    assert call(served, "GET", "/api/stats")[2]["server"]["disconnects"] == gone_before + 1
    assert running.is_alive()
    blocked.go.set()
    running.join(60)
    assert running_out["value"][0] == 200
    assert call(served, "POST", "/v1/chat/completions", chat_body("after"))[0] == 200


def test_client_disconnect_cancels_and_frees_the_engine(served):
    from llm_mlx_streaming.engine.manager import get_manager

    engine = get_manager()
    done_before = engine.served
    sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=30)
    body = json.dumps(chat_body("go on and on", max_tokens=80, stream=True)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while received.count(b"data:") < 3:
        received += sock.recv(4096)
    gone = call(served, "GET", "/api/stats")[2]["server"]["disconnects"]
    sock.close()  # mid-stream
    wait_for(lambda: not call(served, "GET", "/api/stats")[2]["server"]["running"])
    assert call(served, "GET", "/api/stats")[2]["server"]["disconnects"] == gone + 1
    c = client(served)
    reply = c.chat.completions.create(model="mlx-stream", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.usage.completion_tokens == 4
    assert engine.served == done_before + 1  # the cut generation never ran to its end
    assert engine.bad_slots() == 0


def test_disconnect_before_the_first_token_cancels_a_whole_reply(served, blocked):
    from llm_mlx_streaming.engine.manager import get_manager

    engine = get_manager()
    blocked.go.set()
    call(served, "POST", "/v1/chat/completions", chat_body("warm"))
    blocked.go.clear()
    done_before = engine.served
    sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=30)
    body = json.dumps(chat_body("a long answer please", max_tokens=80)).encode()  # not streamed
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert blocked.entered.wait(30)  # the engine holds it, before its first token
    gone = call(served, "GET", "/api/stats")[2]["server"]["disconnects"]
    sock.close()
    wait_for(lambda: call(served, "GET", "/api/stats")[2]["server"]["disconnects"] == gone + 1)
    blocked.go.set()
    wait_for(lambda: not call(served, "GET", "/api/stats")[2]["server"]["running"])
    assert engine.served == done_before  # cut at its first tokens, never ran to its end
    assert call(served, "POST", "/v1/chat/completions", chat_body("hi"))[0] == 200
    assert engine.served == done_before + 1 and engine.bad_slots() == 0


# -- llm's CLI with the server running ---------------------------------------------------


def test_llm_cli_routes_to_the_server_and_logs_the_same_row(served):
    served.server.service.runtime.values.clear()
    alone = assert_ok(served.run("-m", "mlx-stream", "hello there", "-o", "max_tokens", "8", "-o", "server", "off"))
    routed = assert_ok(served.run("-m", "mlx-stream", "hello there", "-o", "max_tokens", "8"))
    assert routed.stdout == alone.stdout
    rows = served.turns()
    assert "served_by" not in rows[-2]["stats"]
    assert rows[-1]["stats"]["served_by"] == served.server.url
    assert rows[-1]["stats"]["generated_tokens"] == 8 and rows[-1]["output_tokens"] == 8
    assert rows[-1]["resolved_model"] == rows[-2]["resolved_model"]

    follow = assert_ok(served.run("-c", "and then?", "-o", "max_tokens", "5"))
    assert follow.stdout.strip()
    last = served.turns()[-1]["stats"]
    assert last["served_by"] == served.server.url and last["reused_tokens"] > 0

    rows = len(served.turns())
    assert_ok(served.run("chat", "-m", "mlx-stream", "-o", "max_tokens", "4", input="hello\nand again\nquit\n"))
    chat = served.turns()[rows:]
    assert len(chat) == 2 and all(t["stats"]["served_by"] == served.server.url for t in chat)
    assert chat[1]["stats"]["reused_tokens"] >= chat[0]["stats"]["prompt_tokens"]

    assert_ok(served.run("mlxs", "config", "server", "off"))
    assert "served_by" not in (assert_ok(served.run("-m", "mlx-stream", "hi", "-o", "max_tokens", "2"))
                               and served.turns()[-1]["stats"])
    assert_ok(served.run("mlxs", "config", "--unset", "server"))


def test_llm_mlxs_stats_live_and_config_push(served):
    live = assert_ok(served.run("mlxs", "stats", "--live", "--json"))
    assert json.loads(live.stdout)["state"] in ("loaded", "empty")
    shown = assert_ok(served.run("mlxs", "stats", "--live")).stdout
    assert served.server.url in shown
    assert "a batch of up to" not in shown and "peak memory" not in shown  # the rows above say them, once
    out = assert_ok(served.run("mlxs", "config", "max_tokens", "5"))
    assert "applied to the server" in out.stderr
    assert call(served, "GET", "/api/engine/config")[2]["max_tokens"] == 5
    assert_ok(served.run("mlxs", "config", "--unset", "max_tokens"))
    assert "max_tokens" not in served.server.service.runtime.values


def test_server_dying_mid_request_is_one_line(llm_env):
    from llm_mlx_streaming import discovery

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def dying_server():
        conn, _ = listener.accept()  # /health: it is the server the file names
        conn.recv(65536)
        health = json.dumps({"status": "ok", "id": discovery.public_id("s")}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(health)).encode() + b"\r\n\r\n" + health)
        conn.close()
        conn, _ = listener.accept()
        conn.recv(65536)
        chunk = {"choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": None}]}
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                     + f"data: {json.dumps(chunk)}\n\n".encode())
        conn.close()

    t = threading.Thread(target=dying_server, daemon=True)
    t.start()
    discovery.write(discovery.ServerInfo(os.getpid(), "127.0.0.1", port, "s"))
    try:
        result = llm_env.run("-m", "mlx-stream", "hi")
        assert_one_line_error(result, "stopped during the request")
    finally:
        discovery.remove_stale()
        listener.close()


# -- security and bad input ----------------------------------------------------------------


def test_non_loopback_bind_needs_an_api_key(llm_env):
    result = llm_env.run("mlxs", "serve", "--host", "0.0.0.0", "--port", "0")
    assert_one_line_error(result, "--api-key")


def test_api_key_discovery_file_and_stale_files(tmp_path, monkeypatch, plugin_checkpoint):
    from llm_mlx_streaming import discovery
    from llm_mlx_streaming.server.process.run import Server

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    env = LlmEnv(tmp_path / "llm", plugin_checkpoint)
    env.write_settings(default_model="small", models={"small": {"path": str(plugin_checkpoint), "expert_slots": 4}})
    with Server(port=0, api_key="sesame") as server:
        env.server = server
        path = discovery.discovery_path()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert discovery.read().port == server.port
        assert call(env, "GET", "/health")[0] == 200
        status, _, body = call(env, "GET", "/v1/models")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert call(env, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert call(env, "GET", "/v1/models", headers={"Authorization": "Bearer sesame"})[0] == 200
        # changing the engine's parameters is a write: it needs the key too
        assert call(env, "POST", "/api/engine/config", {"max_tokens": 3})[0] == 401
        assert call(env, "GET", "/api/engine/config")[0] == 401
        key = {"Authorization": "Bearer sesame"}
        assert call(env, "GET", "/api/engine/config", headers=key)[2]["max_tokens"] == 256
        assert call(env, "POST", "/api/engine/config", {"max_tokens": 3}, headers=key)[2]["max_tokens"] == 3
        # the llm CLI authenticates with the per-server secret from the discovery file
        assert_ok(env.run("-m", "mlx-stream", "hi", "-o", "max_tokens", "2"))
        assert env.turns()[-1]["stats"]["served_by"] == server.url
        assert_one_line_error(env.run("mlxs", "serve", "--port", "0"), "already runs")
    assert not path.exists()  # removed when the server stopped

    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    discovery.write(discovery.ServerInfo(dead, "127.0.0.1", 9, "x"))
    assert discovery.read() is None and not path.exists()  # stale: its process is gone


def test_malformed_and_oversized_bodies(served):
    status, _, body = call(served, "POST", "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and set(body["error"]) >= {"message", "type"}
    status, _, body = call(served, "POST", "/v1/chat/completions", {"messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    status, _, body = call(served, "POST", "/v1/chat/completions", chat_body("hi", model="gpt-4"))
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, _, body = call(served, "GET", "/v1/chat/completions")
    assert status == 405 and body["error"]["message"] == "Method Not Allowed"
    assert call(served, "GET", "/api/chat")[2] == {"error": "Method Not Allowed"}
    from llm_mlx_streaming.server.errors import max_body_bytes

    cap = max_body_bytes()
    declared = f"Content-Length: {cap + 1}\r\n\r\n".encode()
    assert raw_status(served, declared) == 413  # refused before the body is read
    chunk = b"x" * 2**20
    chunks = cap // len(chunk) + 1
    chunked = b"Transfer-Encoding: chunked\r\n\r\n" + (b"100000\r\n" + chunk + b"\r\n") * chunks + b"0\r\n\r\n"
    assert raw_status(served, chunked) == 413  # counted as it streams in
    status, _, body = call(served, "POST", "/v1/chat/completions", chat_body("hi", max_tokens=100000))
    assert status == 200 and body["usage"]["total_tokens"] <= 96  # capped by the context
    assert body["choices"][0]["finish_reason"] == "length"
    long_prompt = " ".join(["word"] * 400)  # longer than max_context 96: one line, not a 500
    status, _, body = call(served, "POST", "/v1/chat/completions", chat_body(long_prompt))
    assert status == 400 and "longer than" in body["error"]["message"]


CURL_D = {"Content-Type": "application/x-www-form-urlencoded", "User-Agent": "curl/8.5.0", "Accept": "*/*"}
POSTS = [("/v1/chat/completions", "openai"), ("/v1/completions", "openai"), ("/v1/responses", "openai"),
         ("/api/engine/config", "openai"), ("/v1/messages", "anthropic"), ("/v1/messages/count_tokens", "anthropic"),
         ("/api/chat", "ollama"), ("/api/generate", "ollama"), ("/api/show", "ollama")]


def error_message(api: str, reply: dict) -> str:
    """The message of an error object, asserted to be in `api`'s shape."""
    if api == "ollama":
        assert set(reply) == {"error"}, reply
        return reply["error"]
    if api == "anthropic":
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error", reply
        return reply["error"]["message"]
    assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
    return reply["error"]["message"]


def test_a_chat_completion_posted_with_curl_d_is_answered_whole_and_streamed(served):
    """`curl -d` labels its body a form: a body is JSON because it parses as JSON."""
    expected = client(served).chat.completions.create(**chat_body("hello there")).choices[0].message.content
    body = json.dumps(chat_body("hello there")).encode()
    status, _, whole = send(served, "POST", "/v1/chat/completions", body, CURL_D)
    assert status == 200 and json.loads(whole)["choices"][0]["message"]["content"] == expected, whole
    body = json.dumps(chat_body("hello there", stream=True)).encode()
    status, head, streamed = send(served, "POST", "/v1/chat/completions", body, CURL_D)
    chunks = [json.loads(line[6:]) for line in streamed.decode().splitlines() if line.startswith("data: {")]
    assert status == 200 and head["content-type"].startswith("text/event-stream")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == expected


@pytest.mark.parametrize("label", [None, "application/json", "application/x-www-form-urlencoded", "text/plain"])
def test_a_body_that_is_not_json_is_one_400_line_in_the_shape_of_each_api(served, label):
    headers = {"Content-Type": label} if label else {}
    for path, api in POSTS:
        for body in (b"{not json", b"model=mlx-stream&prompt=hi", b'{"model": "\xff"}'):
            status, _, reply = send(served, "POST", path, body, headers)
            message = error_message(api, json.loads(reply))
            assert status == 400 and message.startswith("the request body is not JSON: "), (path, body, reply)
            assert "\n" not in message
    for body, said in ((b"", "the request has no body: send a JSON object"),
                       (b"[1]", "the request body is not a JSON object")):
        status, _, reply = send(served, "POST", "/api/chat", body, headers)
        assert status == 400 and json.loads(reply) == {"error": said}


def _no_server_error(url: str, operations: list, examples: int) -> None:
    """Schemathesis's cases of `operations`, `examples` of them: none answered 5xx."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of([op.as_strategy() for op in operations]))
    def no_server_error(case):
        response = case.call(base_url=url, timeout=60)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])

    no_server_error()


def test_schemathesis_finds_no_server_error(served):
    import schemathesis

    url = served.server.url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/api/engine/config", "/api/stats",
                                              "/v1/messages", "/v1/messages/count_tokens", "/api/chat",
                                              "/api/generate", "/api/tags", "/api/show", "/api/ps", "/v1/responses"}

    _no_server_error(url, operations, examples=120)
    served.server.service.runtime.values.clear()  # what the fuzzer configured
    from llm_mlx_streaming.engine.manager import get_manager

    assert get_manager().bad_slots() == 0


def test_schema_through_the_api_and_through_a_routed_llm_prompt(served):
    import llm

    schema = llm.schema_dsl("word, count int")
    body = call(served, "POST", "/v1/chat/completions", chat_body("a word", max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": schema}}))[2]
    value = json.loads(body["choices"][0]["message"]["content"])
    assert set(value) == {"word", "count"} and isinstance(value["count"], int)

    args = ["-m", "mlx-stream", "a word", "--schema", "word, count int", "-o", "max_tokens", "40"]
    alone = assert_ok(served.run(*args, "-o", "server", "off")).stdout
    routed = assert_ok(served.run(*args)).stdout
    assert routed == alone and json.loads(routed)
    assert served.turns()[-1]["stats"]["served_by"] == served.server.url

    short = call(served, "POST", "/v1/chat/completions", chat_body("a word", max_tokens=2, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": schema}}))[2]
    assert short["choices"][0]["finish_reason"] == "length"
    cut = assert_ok(served.run("-m", "mlx-stream", "a word", "--schema", "word, count int", "-o", "max_tokens", "2"))
    assert "max_tokens ended the reply before the --schema document" in cut.stderr
    assert served.turns()[-1]["stats"]["schema_closed"] is False


def test_a_server_that_does_not_answer_is_one_line(llm_env):
    from llm_mlx_streaming import discovery

    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    discovery.write(discovery.ServerInfo(os.getpid(), "127.0.0.1", port, "s"))
    try:
        line = assert_one_line_error(llm_env.run("-m", "mlx-stream", "hi"), "is not answering", "-o server off")
        assert str(discovery.discovery_path()) in line
        assert_ok(llm_env.run("-m", "mlx-stream", "hi", "-o", "max_tokens", "2", "-o", "server", "off"))
    finally:
        discovery.remove_stale()


@pytest.mark.parametrize("fields", [
    {"port": 99999}, {"port": -5}, {"port": "80"}, {"host": "not a host!"}, {"pid": 0}, {"pid": -1},
    {"secret": ""}, None,
])
def test_a_damaged_discovery_file_is_removed_with_a_notice_and_the_prompt_runs(llm_env, fields):
    from llm_mlx_streaming import discovery

    path = discovery.discovery_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"pid": os.getpid(), "host": "127.0.0.1", "port": 9, "secret": "s"}
    path.write_text(json.dumps(None if fields is None else {**data, **fields}))
    result = assert_ok(llm_env.run("-m", "mlx-stream", "hi", "-o", "max_tokens", "2"))
    notices = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(notices) == 1 and notices[0].startswith(f"Removed {path}: "), result.stderr
    assert not path.exists() and "served_by" not in llm_env.turns()[-1]["stats"]


def test_a_discovery_file_whose_port_another_program_took_is_removed(llm_env):
    import http.server

    from llm_mlx_streaming import discovery

    other = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    thread = threading.Thread(target=other.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        discovery.write(discovery.ServerInfo(os.getpid(), "127.0.0.1", other.server_address[1], "s"))
        result = assert_ok(llm_env.run("-m", "mlx-stream", "hi", "-o", "max_tokens", "2"))
        assert "is not the mlx-stream server it names" in result.stderr
        assert not discovery.discovery_path().exists()
    finally:
        other.shutdown()
        other.server_close()
        thread.join(timeout=5)


def test_a_cancelled_async_prompt_hangs_up_on_the_server(served, monkeypatch):
    import asyncio

    import llm
    from llm_mlx_streaming.reply.core import AsyncReply
    from llm_mlx_streaming.reply.events import Chunk

    real_events = AsyncReply.events
    hung_up = threading.Event()

    async def held_events(self):  # the rest of the reply waits until the client is gone
        async for event in real_events(self):
            yield event
            if isinstance(event, Chunk):
                await asyncio.get_running_loop().run_in_executor(None, hung_up.wait, 60)

    monkeypatch.setattr(AsyncReply, "events", held_events)
    gone = call(served, "GET", "/api/stats")[2]["server"]["disconnects"]

    async def cancel_after_first_chunk():
        got = asyncio.Event()

        async def consume():
            async for _ in llm.get_async_model("mlx-stream").prompt("tell me everything", max_tokens=60):
                got.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        hung_up.set()

    try:
        asyncio.run(cancel_after_first_chunk())
    finally:
        hung_up.set()
    wait_for(lambda: call(served, "GET", "/api/stats")[2]["server"]["disconnects"] == gone + 1)


@pytest.mark.parametrize("stop_signal,quiet", [("SIGINT", False), ("SIGTERM", True)])
def test_the_serve_command_runs_until_stopped_and_cleans_up(llm_env, stop_signal, quiet):
    """It says where things are, logs each request (not with --quiet), and stops cleanly."""
    import signal
    import subprocess
    import sys

    from llm_mlx_streaming import discovery

    env = {**os.environ, "LLM_USER_PATH": str(llm_env.user_dir)}
    llm_bin = os.path.join(os.path.dirname(sys.executable), "llm")
    proc = subprocess.Popen([llm_bin, "mlxs", "serve", "--port", "0", "--max-queue", "2", *(["--quiet"] * quiet)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, b"")), daemon=True).start()
    try:
        wait_for(lambda: discovery.read() is not None or proc.poll() is not None, timeout=60)
        info = discovery.read()
        assert info is not None and info.pid == proc.pid, lines
        wait_for(lambda: any(b"GET /v1/models lists them" in line for line in lines) or proc.poll() is not None)
        with urllib.request.urlopen(info.url + "/health", timeout=30) as resp:
            assert json.loads(resp.read()) == {"status": "ok", "id": discovery.public_id(info.secret)}
        proc.send_signal(getattr(signal, stop_signal))
        assert proc.wait(30) == 0
        assert not discovery.discovery_path().exists()
        wait_for(lambda: any(b"server stopped" in line for line in lines))  # read to its end
        said = b"".join(lines).decode()
        assert "serving on " + info.url in said and "server stopped" in said and "Traceback" not in said
        assert f"mlx-stream: ready on {info.url}:\n  dashboard  {info.url}/dashboard" in said
        assert ("GET /health 200 " in said) is not quiet
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_seeded_penalised_completion_is_the_same_when_its_prompt_is_cached(served):
    """The second identical request reuses the first one's KV; the repetition penalty
    and the seed must still see what they saw cold."""
    from llm_mlx_streaming.engine.manager import get_manager

    if get_manager().prompts is not None:
        get_manager().prompts.reset()
    body = {"model": "mlx-stream", "prompt": "abc abc def def ghi ghi", "max_tokens": 10,
            "temperature": 0.8, "seed": 7, "repetition_penalty": 3.0}
    replies = [call(served, "POST", "/v1/completions", body)[2] for _ in range(3)]
    assert all(r["mlx_stream"]["stats"]["reused_tokens"] > 0 for r in replies[1:])
    assert [r["choices"][0]["text"] for r in replies] == [replies[0]["choices"][0]["text"]] * 3


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "echo", True),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "presence_penalty", 0.5),
    ("/v1/chat/completions", "top_logprobs", 2),
    ("/v1/completions", "logit_bias", {"5": 1.0}),
])
def test_a_field_that_changes_the_reply_and_is_not_honoured_is_a_400_naming_it(served, path, field, value):
    body = dict(CHAT) if "chat" in path else {"prompt": "hi", "max_tokens": 2}
    status, _, reply = call(served, "POST", path, {**body, field: value})
    assert status == 400, reply
    assert reply["error"]["message"].startswith(field) or f"{field} " in reply["error"]["message"], reply


@pytest.mark.parametrize("path,body,alive", [
    ("/v1/chat/completions", {**CHAT, "stream": True}, b": waiting for the first token"),
    ("/v1/messages", {**CHAT, "model": "mlx-stream", "stream": True}, b"event: ping"),
    ("/v1/responses", {"model": "mlx-stream", "input": "hi", "max_output_tokens": 2, "stream": True},
     b": waiting for the first token"),
])
def test_a_stream_keeps_alive_while_its_prompt_prefills(served, blocked, monkeypatch, path, body, alive):
    """Until the first token, a stream says it is alive (here every 50 ms, 5 s in use),
    so that no client gives up during a long prefill; the reply then comes as usual."""
    from llm_mlx_streaming.server import turns

    monkeypatch.setattr(turns, "KEEPALIVE_SECONDS", 0.05)
    request = urllib.request.Request(served.server.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200
        seen = 0
        while seen < 3:  # the prompt is held in its rendering until then
            seen += resp.readline().startswith(alive)
        blocked.go.set()
        rest = resp.read()
    assert b"[DONE]" in rest or b"message_stop" in rest or b"response.completed" in rest


def test_schemathesis_finds_no_server_error_in_the_responses_api(served):
    import schemathesis

    url = served.server.url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if op.path.startswith("/v1/responses")]
    assert {op.method.upper() for op in operations} == {"POST", "GET", "DELETE"}

    _no_server_error(url, operations, examples=40)
    images = {"model": "mlx-stream", "input": [{"role": "user", "content": [
        {"type": "input_image", "text": "a picture", "image_url": "data:image/png;base64,AA"}]}]}
    status, _, reply = call(served, "POST", "/v1/responses", images)  # what the fuzzer found once
    assert status == 400 and reply["error"]["message"] == "mlx-stream takes no images: it is a text-only model"


def test_model_aliases_and_any_model_land_on_the_served_model(tmp_path, plugin_checkpoint):
    from server_support import small_server

    body = {**CHAT, "model": "claude-sonnet-4-5"}
    with small_server(tmp_path / "a", plugin_checkpoint, aliases={"claude-sonnet-4-5": "small"}) as env:
        status, _, reply = call(env, "POST", "/v1/chat/completions", body)
        assert status == 200 and reply["model"] == "mlx-stream/small", reply
        assert call(env, "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-x"})[0] == 404
    with small_server(tmp_path / "b", plugin_checkpoint, any_model=True) as env:
        status, _, reply = call(env, "POST", "/v1/messages", {**body, "model": "claude-haiku-4-5"})
        assert status == 200 and reply["model"] == "mlx-stream/small", reply


def test_a_suffix_on_a_model_without_fim_tokens_is_a_400_naming_it(served):
    status, _, reply = call(served, "POST", "/v1/completions", {"prompt": "def f(", "suffix": "):", "max_tokens": 2})
    assert status == 400 and reply["error"]["message"].startswith("suffix: this model has no fill-in-the-middle")


def test_hints_and_unknown_fields_are_accepted_and_named_in_a_header(served):
    messages = [{"role": "user", "content": "hi", "name": "bob", "x_note": 1}]
    body = {**CHAT, "messages": messages, "metadata": {"a": "b"}, "store": False, "foo": 1}
    status, headers, reply = call(served, "POST", "/v1/chat/completions", body)
    assert status == 200, reply
    named = headers["x-mlx-stream-ignored"].split(", ")
    assert sorted(named) == ["foo", "messages.name", "messages.x_note", "metadata", "store"]
    same, _, plain = call(served, "POST", "/v1/chat/completions", CHAT)
    assert plain["choices"][0]["message"] == reply["choices"][0]["message"]  # they changed nothing


def test_the_header_names_the_ignored_fields_of_a_stream_too(served):
    request = urllib.request.Request(served.server.url + "/v1/chat/completions", method="POST",
                                     data=json.dumps({**CHAT, "stream": True, "user": "u"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.headers["x-mlx-stream-ignored"] == "user"
        assert resp.read().endswith(b"data: [DONE]\n\n")
    assert "x-mlx-stream-ignored" not in {k.lower() for k in call(served, "POST", "/v1/chat/completions", CHAT)[1]}


def test_a_strict_server_refuses_an_unknown_field_and_names_it(tmp_path, plugin_checkpoint):
    from server_support import small_server

    with small_server(tmp_path / "llm", plugin_checkpoint, strict=True) as strict:
        status, _, reply = call(strict, "POST", "/v1/chat/completions", {**CHAT, "foo": 1})
        assert status == 400 and reply["error"]["message"].startswith("foo: not a field"), reply
        status, headers, _ = call(strict, "POST", "/v1/chat/completions", {**CHAT, "user": "u"})
        assert status == 200 and headers["x-mlx-stream-ignored"] == "user"  # a declared hint


def test_openai_fields_at_their_no_op_value_are_accepted(served):
    body = {**CHAT, "user": "u1", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                       "schema": {"type": "object"}}}}
    status, _, reply = call(served, "POST", "/v1/chat/completions", body)
    assert status == 200, reply
    assert reply["choices"][0].get("logprobs") is None and "logprobs" not in reply["mlx_stream"]["stats"]


def test_logprobs_of_chat_and_completions(served):
    """Each generated token's log-probability, with the most likely alternatives: greedy
    decoding takes the likeliest, so it is the first alternative."""
    c = client(served)
    messages = [{"role": "user", "content": "hello there"}]
    reply = c.chat.completions.create(model="mlx-stream", messages=messages, max_tokens=6, logprobs=True,
                                      top_logprobs=3)
    content = reply.choices[0].logprobs.content
    # (the reply's text drops its first token's leading space, as mlx-lm's detokenizer does)
    text = reply.choices[0].message.content
    assert "".join(e.token for e in content) in (text, " " + text)
    assert len(content) == reply.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0 and bytes(e.bytes).decode() == e.token
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.logprob == e.top_logprobs[0].logprob
    plain = c.chat.completions.create(model="mlx-stream", messages=messages, max_tokens=6)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text

    streamed = []
    for chunk in c.chat.completions.create(model="mlx-stream", messages=messages, max_tokens=6, logprobs=True,
                                           stream=True):
        for choice in chunk.choices:
            streamed += choice.logprobs.content if choice.logprobs else []
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == [(e.token, e.logprob, []) for e in content]

    completion = c.completions.create(model="mlx-stream", prompt="abc def", max_tokens=5, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) in (completion.choices[0].text, " " + completion.choices[0].text)
    assert len(logprobs.token_logprobs) == 5
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0


def test_llm_top_logprobs_is_logged_the_same_routed_or_in_process(served):
    assert_ok(served.run("-m", "mlx-stream", "hi", "-o", "top_logprobs", "2", "-o", "max_tokens", "3"))
    routed = served.turns()[-1]["stats"]
    assert_ok(served.run("-m", "mlx-stream", "hi", "-o", "top_logprobs", "2", "-o", "max_tokens", "3",
                         "-o", "server", "off"))
    local = served.turns()[-1]["stats"]
    assert routed["served_by"] == served.server.url and "served_by" not in local
    assert routed["logprobs"] == local["logprobs"] and len(local["logprobs"]) == 3
    assert all(len(e["top_logprobs"]) == 2 for e in local["logprobs"])


# -- where things are, and what each request did -------------------------------------


def test_the_root_answers_a_probe_with_the_dashboards_address(served):
    status, headers, body = send(served, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"llm-mlx-streaming is running" in body and b"/dashboard" in body
    status, _, body = send(served, "HEAD", "/")
    assert status == 200 and body == b""


def test_the_openai_client_retrieves_a_model_and_is_told_embeddings_are_not_served(served):
    import openai

    c = client(served)
    assert c.models.retrieve("mlx-stream/small").id == "mlx-stream/small"
    assert c.models.retrieve("sm").id == "mlx-stream/small"  # an alias names the model it stands for
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        c.embeddings.create(model="mlx-stream", input="hello")
    assert "not supported by this server" in e.value.body["message"]
    status, _, reply = call(served, "GET", "/v1/no-such-route")
    assert status == 404 and reply["error"]["message"].startswith("GET /v1/no-such-route: no such route")


def test_each_request_is_one_log_line_and_a_capped_value_is_named_in_a_header(served, caplog):
    from llm_mlx_streaming.server.request_log import CAPPED_HEADER

    caplog.set_level("INFO", logger="llm_mlx_streaming.server.request_log")
    status, headers, reply = call(served, "POST", "/v1/chat/completions",
                                  chat_body("a prompt of its own", max_tokens=100_000, expert_slots=1000))
    assert status == 200
    generated = reply["usage"]["completion_tokens"]
    assert reply["mlx_stream"]["stats"]["capped"] == {"max_tokens": [100_000, generated], "expert_slots": [1000, 8]}
    assert headers[CAPPED_HEADER] == f"max_tokens={generated}, expert_slots=8"
    call(served, "GET", "/v1/models")
    status, headers, _ = send(served, "POST", "/v1/chat/completions", json.dumps(
        chat_body("a prompt of its own", max_tokens=100_000, stream=True)).encode(), {"Content-Type": "application/json"})
    assert status == 200 and headers[CAPPED_HEADER] == f"max_tokens={generated}"

    def logged():  # this test's (an earlier test's last line may come in late)
        found = [r.getMessage() for r in caplog.records if r.name.endswith("request_log")]
        return [line for line in found if "capped max_tokens 100000->" in line or line.startswith("GET /v1/models ")]

    wait_for(lambda: len(logged()) == 3)  # each once its response has been sent
    lines = logged()
    prompt, cached = reply["usage"]["prompt_tokens"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert lines[0].startswith("POST /v1/chat/completions 200 ")
    assert lines[0].endswith(f"s mlx-stream prompt {prompt} (cached {cached}) generated {generated} "
                             f"capped max_tokens 100000->{generated}, expert_slots 1000->8")
    assert lines[1].startswith("GET /v1/models 200 ") and "prompt" not in lines[1]
    assert re.search(rf"s mlx-stream prompt {prompt} \(cached \d+\) generated {generated} "
                     rf"capped max_tokens 100000->{generated}$", lines[2]), lines[2]


def test_the_server_says_where_things_are_once_its_model_is_loaded(tmp_path, plugin_checkpoint):
    from server_support import small_server

    said = []
    with small_server(tmp_path / "llm", plugin_checkpoint, model="small", api_key="sesame",
                      say=lambda text, end="\n": said.append(text)) as env:
        wait_for(lambda: env.server.banner.shown)
        url = env.server.url
        assert said[0] == "loading mlx-stream/small..."
        assert said[1].startswith(f"ready on {url} (loaded in ") and said[1].endswith("s):")
        text = "\n".join(said)
        for where in (f"{url}/dashboard", f"OpenAI     {url}/v1", f"Anthropic  {url} ", f"Ollama     {url} ",
                      "Authorization: Bearer KEY"):
            assert where in text, where
        memory = env.server.service.models_figures()[0]["memory_bytes"]
        from llm_mlx_streaming.sizes import format_size

        assert said[-1].startswith(f"  models     mlx-stream/small ({format_size(memory)}, 4 expert slots per "
                                   "layer")  # and pinned, unless this process loaded it before
        assert said[-1].endswith(" loaded; 1 more load on request; GET /v1/models lists them")
