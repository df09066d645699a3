"""Helpers for the dashboard, /metrics and pictures tests: a server whose prompts may be
long, a prefill held half-way, the event stream's frames, /metrics parsed."""

from __future__ import annotations

import http.client
import json
import threading
import time
from contextlib import contextmanager

import pytest

from plugin_support import LlmEnv, serving

LONG = " ".join(f"word{i % 50} and more text" for i in range(120))  # several hundred tokens


@contextmanager
def dash_server(user_dir, checkpoint, **kwargs):
    """The tiny checkpoint served as 'small' (4 of 8 expert slots, max_context 2048, so a
    prompt may span several prefill chunks); `kwargs` go to the server."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(user_dir))
        env = LlmEnv(user_dir, checkpoint)
        env.write_settings(default_model="small", max_context=2048, max_batch=1,
                           models={"small": {"path": str(checkpoint), "aliases": ["sm"], "expert_slots": 4}})
        with serving(env, max_queue=8, **kwargs):
            yield env


def app_of(env):
    """The FastAPI app the server runs (its state: feed, metrics)."""
    return env.server.uvicorn.config.app


def request(env, method, path, body=None, headers=None, timeout=60):
    """(status, headers, body bytes) of one request with exactly these headers."""
    conn = http.client.HTTPConnection("127.0.0.1", env.server.port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def frames(env, count, headers=None, timeout=30):
    """The first `count` frames of /dashboard/events (then the connection is closed)."""
    conn = http.client.HTTPConnection("127.0.0.1", env.server.port, timeout=timeout)
    out = []
    try:
        conn.request("GET", "/dashboard/events", headers=headers or {})
        resp = conn.getresponse()
        assert resp.status == 200, (resp.status, resp.read())
        assert resp.getheader("content-type").startswith("text/event-stream")
        data = []
        while len(out) < count:
            line = resp.fp.readline().decode()
            assert line, "the stream ended"
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "\n" and data:
                out.append(json.loads("".join(data)))
                data = []
    finally:
        conn.close()
    return out


def metrics(env, headers=None) -> dict:
    """/metrics parsed with prometheus_client's parser: {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, head, body = request(env, "GET", "/metrics", headers=headers)
    assert status == 200, body
    assert head["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


class HeldPrefill:
    """Holds the engine thread inside the next prefill once part of it is done (and
    before the rest), until `go` is set: the prefill is in progress, deterministically."""

    def __init__(self, monkeypatch) -> None:
        from llm_mlx_streaming.activity import ACTIVITY

        self.entered, self.go = threading.Event(), threading.Event()
        real = ACTIVITY.prefilled

        def prefilled(flight, done, total=None):
            real(flight, done, total)
            if 0 < flight.prefill_done < flight.prefill_total and not self.go.is_set():
                self.entered.set()
                assert self.go.wait(60)

        monkeypatch.setattr(ACTIVITY, "prefilled", prefilled)


@pytest.fixture
def held_prefill(monkeypatch):
    hold = HeldPrefill(monkeypatch)
    yield hold
    hold.go.set()


def in_thread(fn, *args, **kwargs):
    out = {}

    def work():
        try:
            out["value"] = fn(*args, **kwargs)
        except Exception as e:  # pragma: no cover - reported by the caller
            out["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    return t, out


def wait_until(predicate, timeout=30.0, every=0.05, what=None):
    """`predicate()`'s first true value within `timeout` seconds (`what()`: shown if not)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out{': ' + repr(what()) if what else ''}"
        time.sleep(every)
