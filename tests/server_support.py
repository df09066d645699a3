"""A server on a free loopback port for the server tests, the plugin's own greedy reply
to compare with, and one request without any client library."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from plugin_support import LlmEnv, serving


@contextmanager
def small_server(user_dir, checkpoint, max_batch=1, settings=None, **kwargs):
    """An llm user dir serving the tiny checkpoint as 'small' (alias 'sm', the default
    model, 4 slots; max_context 96 keeps fuzzed replies short; one request at a time
    unless `max_batch` says otherwise; `settings`: more of them), and a server for it
    (`kwargs` go to the server), stopped at the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(user_dir))
        env = LlmEnv(user_dir, checkpoint)
        env.write_settings(**{"default_model": "small", "max_context": 96, "max_batch": max_batch, **(settings or {})},
                           models={"small": {"path": str(checkpoint), "aliases": ["sm"], "expert_slots": 4}})
        with serving(env, max_queue=8, **kwargs):
            yield env


@pytest.fixture(scope="module")
def served(tmp_path_factory, plugin_checkpoint):
    """`small_server` for the tests of one module (import it there)."""
    with small_server(tmp_path_factory.mktemp("served") / "llm", plugin_checkpoint) as env:
        yield env


def in_process(messages, **options) -> str:
    """The plugin's own output for `messages`, never routed to the server."""
    import llm
    from llm.parts import Message, TextPart

    chain = [Message(role=m["role"], parts=[TextPart(text=m["content"])]) for m in messages]
    return llm.get_model("mlx-stream").prompt(messages=chain, server="off", **options).text()


def call(served, method, path, body=None, headers=None, raw=None):
    """(status, headers, parsed JSON body) of one request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(served.server.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.headers, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"null")


def send(served, method, path, body: bytes | None = None, headers=None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request with exactly `headers` (http.client adds
    Host, Content-Length and Accept-Encoding where not given; urllib would add a Content-Type)."""
    conn = http.client.HTTPConnection("127.0.0.1", served.server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def wait_for(predicate, timeout=30.0):
    """Until `predicate()` holds (an event the server reports), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
