"""A server that runs for long: a few hundred mixed requests through one server (every
API, streamed and whole, clients hanging up), then every cache it keeps is within its
setting and MLX's active memory is back at its idle level (benchmarks/soak.py runs
the same at scale, docs/benchmarks.md "Soak")."""

from __future__ import annotations

import gc
import http.client
import json
import os
import threading
from collections import Counter

import pytest

from plugin_support import assert_one_line_error
from server_support import call, small_server, wait_for

REQUESTS, CLIENTS = 300, 8
SETTINGS = {"reply_memory": 8, "conversation_cache_size": "64KB", "conversation_cache_entries": 3,
            "buffer_cache": "2MB"}
ROUTES = [  # path, body for (prompt, stream)
    ("/v1/chat/completions", lambda p, s: {"messages": [{"role": "user", "content": p}], "max_tokens": 6, "stream": s}),
    ("/v1/completions", lambda p, s: {"prompt": p, "max_tokens": 6, "stream": s}),
    ("/v1/messages", lambda p, s: {"messages": [{"role": "user", "content": p}], "max_tokens": 6, "stream": s}),
    ("/api/chat", lambda p, s: {"messages": [{"role": "user", "content": p}], "options": {"num_predict": 6},
                                "stream": s}),
    ("/api/generate", lambda p, s: {"prompt": p, "options": {"num_predict": 6}, "stream": s}),
]
FIXED = {"messages": [{"role": "user", "content": "the same words every time"}], "max_tokens": 6}


def send(port: int, i: int) -> str:
    """Request `i` of the mix: its route, streamed or not, hung up before the answer or
    after the first streamed line for some; returns how it ended."""
    path, body = ROUTES[i % len(ROUTES)]
    stream = i % 2 == 1
    prompt = f"request {i} " + "words of a longer prompt " * (i % 5)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, json.dumps({"model": "sm", **body(prompt, stream)}),
                     {"Content-Type": "application/json"})
        if i % 10 == 3:
            return "hung up before the answer"
        resp = conn.getresponse()
        if resp.status != 200:
            return f"status {resp.status}"
        if stream and i % 6 == 1:
            resp.readline()
            return "hung up mid-stream"
        resp.read()
        return "answered"
    finally:
        conn.close()


def stats(env) -> dict:
    return call(env, "GET", "/api/stats")[2]


def idle(env) -> bool:
    """Nothing runs or waits (a cancelled generation included), freed memory given back."""
    s = stats(env)
    return s["engine_idle"] and not (s["server"]["running"] or s["server"]["queued"])


def active(env) -> int:
    gc.collect()  # what a finished request left in a reference cycle is not kept
    return stats(env)["mlx_active_memory_bytes"]


def fixed_then_idle(env) -> dict:
    status, _, body = call(env, "POST", "/v1/chat/completions", FIXED)
    assert status == 200, body
    wait_for(lambda: idle(env))
    return body


def test_caches_stay_within_their_settings_and_mlx_memory_returns_to_idle(tmp_path, plugin_checkpoint):
    with small_server(tmp_path / "llm", plugin_checkpoint, max_batch=4, settings=SETTINGS) as env:
        first = fixed_then_idle(env)
        idle_active = active(env)
        pools_before = stats(env)["server"]["threads"]
        saved = first["mlx_stream"]["stats"]["disk_cache_saved_bytes"]
        assert saved * REQUESTS > 4 * 64_000  # the quota is hit many times over

        ended, seen, lock = Counter(), [], threading.Lock()
        pending = iter(range(REQUESTS))

        def client() -> None:
            for _ in range(REQUESTS):
                with lock:
                    i = next(pending, None)
                if i is None:
                    return
                outcome = send(env.server.port, i)
                with lock:
                    ended[outcome] += 1
                    if i % 50 == 0:
                        seen.append(stats(env)["caches"])

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert set(ended) == {"answered", "hung up mid-stream", "hung up before the answer"}, ended
        assert sum(ended.values()) == REQUESTS

        again = fixed_then_idle(env)
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        wait_for(lambda: active(env) == idle_active)  # the same weights, pools and prompt cache (max_context 96: room for one conversation)
        caches = stats(env)["caches"]
        for kept in seen + [caches]:
            assert kept["reply_memory"]["entries"] <= kept["reply_memory"]["max_entries"] == 8
            assert kept["buffer_cache"]["bytes"] <= kept["buffer_cache"]["max_bytes"] == 2_000_000
            disk = kept["conversation_cache"]
            assert disk["bytes"] <= disk["max_bytes"] == 64_000 and disk["entries"] <= disk["max_entries"] == 3
            held = kept["prompt_cache"]
            assert held["bytes"] <= held["max_bytes"] and kept["drafters"]["entries"] <= 1
        assert caches["reply_memory"]["entries"] == 8
        pools = stats(env)["server"]["threads"]
        assert pools.get("asyncio_", 0) <= min(32, (os.cpu_count() or 1) + 4)  # the loop's executor, bounded
        assert pools.get("Thread-", 0) <= pools_before.get("Thread-", 0)  # no thread per request outlives it
        on_disk = sum(p.stat().st_size for p in (env.user_dir / "mlx-streaming" / "kv-cache").rglob("*.safetensors"))
        assert on_disk == caches["conversation_cache"]["bytes"] <= 64_000


@pytest.mark.parametrize("key, value", [
    ("reply_memory", "-1"), ("reply_memory", "many"), ("buffer_cache", "lots"), ("buffer_cache", "-5MB"),
    ("conversation_cache_entries", "0"), ("conversation_cache_entries", "1e9"),
])
def test_a_bound_that_makes_no_sense_is_refused_in_one_line(llm_env, key, value):
    assert_one_line_error(llm_env.run("mlxs", "config", key, value), key)
    assert key not in llm_env.read_settings()
