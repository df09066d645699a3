"""A web page cannot drive the server: a foreign Host (DNS rebinding) or Origin is 403.

One server on a free loopback port, with a configured name and origin; requests are
sent with explicit Host and Origin headers, as a browser would send them.
"""

from __future__ import annotations

import http.client
import json

import pytest

from plugin_support import LlmEnv, assert_ok, assert_one_line_error

NAME, ORIGIN = "studio.lan", "http://tool.lan:3000"
ROUTES = [("GET", "/v1/models", None), ("GET", "/api/stats", None), ("GET", "/api/engine/config", None),
          ("POST", "/api/engine/config", {"k": 2}), ("GET", "/openapi.json", None),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
          ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, plugin_checkpoint):
    from llm_mlx_streaming.server.process.run import Server

    user_dir = tmp_path_factory.mktemp("guarded") / "llm"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(user_dir))
        env = LlmEnv(user_dir, plugin_checkpoint)
        env.write_settings(default_model="small", server_hosts=[NAME], server_origins=[ORIGIN],
                           models={"small": {"path": str(plugin_checkpoint), "expert_slots": 4}})
        server = Server(port=0).start()
        env.server = server
        try:
            yield env
        finally:
            server.stop()


def send(env, method, path, body=None, **headers):
    """(status, headers, JSON body) of one request with exactly these Host/Origin headers."""
    conn = http.client.HTTPConnection("127.0.0.1", env.server.port, timeout=60)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.putrequest(method, path, skip_host=True)
        for key, value in {"Host": f"127.0.0.1:{env.server.port}", "Content-Type": "application/json",
                           **{k.replace("_", "-"): v for k, v in headers.items()}}.items():
            if value is not None:
                conn.putheader(key, value)
        conn.putheader("Content-Length", str(len(data or b"")))
        conn.endheaders(data)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read() or b"null")
    finally:
        conn.close()


@pytest.mark.parametrize("method,path,body", ROUTES)
def test_a_foreign_host_is_refused_on_every_route(guarded, method, path, body):
    status, _, reply = send(guarded, method, path, body, Host=f"evil.example:{guarded.server.port}")
    assert status == 403 and reply["error"]["code"] == "host_not_allowed", reply
    assert "evil.example" in reply["error"]["message"]


CHAT = {"model": "mlx-stream", "messages": [{"role": "user", "content": "hi"}]}
OTHER_APIS = [("POST", "/v1/messages", {**CHAT, "max_tokens": 1}), ("POST", "/v1/messages/count_tokens", CHAT),
              ("POST", "/api/chat", {**CHAT, "stream": False}), ("POST", "/api/chat", {"model": "mlx-stream",
                                                                                     "keep_alive": 0}),
              ("POST", "/api/generate", {"model": "mlx-stream", "prompt": "hi", "stream": False}),
              ("GET", "/api/tags", None), ("POST", "/api/show", {"model": "mlx-stream"}), ("GET", "/api/ps", None),
              ("GET", "/api/version", None), ("POST", "/api/pull", {"model": "x"})]


@pytest.mark.parametrize("method,path,body", OTHER_APIS)
@pytest.mark.parametrize("header", ["Host", "Origin"])
def test_a_foreign_host_or_origin_is_refused_in_each_apis_error_shape(guarded, method, path, body, header):
    value = f"evil.example:{guarded.server.port}" if header == "Host" else "http://evil.example"
    status, _, reply = send(guarded, method, path, body, **{header: value})
    assert status == 403, reply
    if path.startswith("/v1/messages"):
        assert reply["type"] == "error" and reply["error"]["type"] == "permission_error"
        assert "evil.example" in reply["error"]["message"]
    else:
        assert set(reply) == {"error"} and "evil.example" in reply["error"]


def test_a_foreign_host_does_not_change_the_engine_config(guarded):
    before = send(guarded, "GET", "/api/engine/config")[2]
    assert send(guarded, "POST", "/api/engine/config", {"k": 3}, Host="evil.example")[0] == 403
    assert send(guarded, "GET", "/api/engine/config")[2] == before


def test_health_answers_any_host(guarded):
    status, _, reply = send(guarded, "GET", "/health", Host="evil.example")
    assert status == 200 and reply["status"] == "ok"


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", NAME, "app.localhost", "192.168.1.7"])
def test_loopback_ip_and_configured_names_are_served(guarded, host):
    status, _, reply = send(guarded, "GET", "/v1/models", Host=f"{host}:{guarded.server.port}")
    assert status == 200, reply


@pytest.mark.parametrize("method,path,body", ROUTES)
def test_a_foreign_origin_is_refused(guarded, method, path, body):
    status, _, reply = send(guarded, method, path, body, Origin="http://evil.example")
    assert status == 403 and reply["error"]["code"] == "origin_not_allowed", reply


def test_an_allowed_origin_gets_cors_and_loopback_pages_are_served(guarded):
    status, headers, _ = send(guarded, "GET", "/v1/models", Origin=ORIGIN)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = send(guarded, "OPTIONS", "/v1/chat/completions", Origin=ORIGIN,
                              Access_Control_Request_Method="POST")
    assert status == 204 and headers["access-control-allow-origin"] == ORIGIN
    for origin in ("http://localhost:5173", f"http://127.0.0.1:{guarded.server.port}"):
        status, headers, _ = send(guarded, "GET", "/v1/models", Origin=origin)
        assert status == 200 and headers["access-control-allow-origin"] == origin


def test_without_configured_origins_no_cors_headers_are_sent():
    import asyncio

    from llm_mlx_streaming.server.guard import Guard

    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def record(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/models", "method": "GET",
             "headers": [(b"host", b"localhost:1"), (b"origin", b"http://localhost:5173")]}
    asyncio.run(Guard(app)(scope, None, record))
    assert sent == [{"type": "http.response.start", "status": 200, "headers": []}]
    asyncio.run(Guard(app)(dict(scope, headers=[(b"host", b"evil.example")]), None, record))
    assert sent[1]["status"] == 403


def test_the_names_are_settings_with_one_line_errors(llm_env):
    assert_ok(llm_env.run("mlxs", "config", "server_hosts", "a.lan, b.lan"))
    assert llm_env.read_settings()["server_hosts"] == ["a.lan", "b.lan"]
    assert_one_line_error(llm_env.run("mlxs", "config", "server_origins", "http://a b"), "server_origins")


def test_the_host_check_is_on_by_default_and_star_turns_it_off():
    import asyncio

    from llm_mlx_streaming.server.guard import Guard

    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def record(message):
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    scope = {"type": "http", "path": "/v1/models", "method": "GET", "headers": [(b"host", b"evil.example")]}
    for guard in (Guard(app), Guard(app, hosts=["studio.lan"]), Guard(app, hosts=["*"])):
        asyncio.run(guard(scope, None, record))
    assert sent == [403, 403, 200]
