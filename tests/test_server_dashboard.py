"""The server's dashboard, /metrics and offline /docs, over HTTP (the browser's view is
tests/test_server_dashboard_browser.py): /metrics parses and equals /api/stats after a
known sequence of requests, the event stream's frames, the key and the Host/Origin guard."""

from __future__ import annotations

import json

import pytest

from dashboard_support import (LONG, app_of, dash_server, frames, held_prefill, in_thread,  # noqa: F401
                               metrics, request, wait_until)


@pytest.fixture(scope="module")
def dash(tmp_path_factory, plugin_checkpoint):
    with dash_server(tmp_path_factory.mktemp("dash") / "llm", plugin_checkpoint) as env:
        yield env


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, plugin_checkpoint):
    with dash_server(tmp_path_factory.mktemp("keyed") / "llm", plugin_checkpoint, api_key="sesame") as env:
        yield env


def post(env, path, body):
    status, _, raw = request(env, "POST", path, body)
    return status, json.loads(raw)


def stats(env) -> dict:
    status, _, raw = request(env, "GET", "/api/stats")
    assert status == 200
    return json.loads(raw)


def value(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


# -- /metrics -------------------------------------------------------------------------
def test_metrics_equal_the_stats_after_a_known_sequence_of_requests(dash):
    before_m, before = metrics(dash), stats(dash)
    chat = {"model": "mlx-stream", "messages": [{"role": "user", "content": "hello metrics"}], "max_tokens": 5}
    prompt_in = tokens_out = 0
    for content in ("hello metrics", "tell me more"):
        status, reply = post(dash, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": content}]})
        assert status == 200, reply
        prompt_in += reply["usage"]["prompt_tokens"]
        tokens_out += reply["usage"]["completion_tokens"]
    status, reply = post(dash, "/v1/completions", {"model": "mlx-stream", "prompt": "once upon", "max_tokens": 4})
    assert status == 200, reply
    prompt_in, tokens_out = prompt_in + reply["usage"]["prompt_tokens"], tokens_out + reply["usage"]["completion_tokens"]
    status, reply = post(dash, "/v1/messages", {"model": "mlx-stream", "max_tokens": 3,
                                                "messages": [{"role": "user", "content": "an anthropic turn"}]})
    assert status == 200, reply
    usage = reply["usage"]  # Anthropic's input_tokens leave out those read from the cache
    prompt_in += usage["input_tokens"] + usage["cache_read_input_tokens"]
    tokens_out += usage["output_tokens"]
    status, reply = post(dash, "/api/chat", {"model": "mlx-stream", "stream": False, "options": {"num_predict": 3},
                                             "messages": [{"role": "user", "content": "an ollama turn"}]})
    assert status == 200, reply
    prompt_in, tokens_out = prompt_in + reply["prompt_eval_count"], tokens_out + reply["eval_count"]
    status, reply = post(dash, "/v1/responses", {"model": "mlx-stream", "input": "a responses turn",
                                                 "max_output_tokens": 2})
    assert status == 200, reply
    prompt_in, tokens_out = prompt_in + reply["usage"]["input_tokens"], tokens_out + reply["usage"]["output_tokens"]
    assert post(dash, "/v1/chat/completions", {"model": "mlx-stream", "messages": []})[0] == 400

    after = stats(dash)  # a runtime request too, counted before /metrics is read
    m = metrics(dash)
    # requests by API and status: exactly the ones sent since the first /metrics
    d = lambda name, **labels: value(m, name, **labels) - value(before_m, name, **labels)  # noqa: E731
    assert d("mlxs_http_requests_total", api="openai", status="200") == 3
    assert d("mlxs_http_requests_total", api="openai", status="400") == 1
    assert d("mlxs_http_requests_total", api="anthropic", status="200") == 1
    assert d("mlxs_http_requests_total", api="ollama", status="200") == 1
    assert d("mlxs_http_requests_total", api="responses", status="200") == 1  # the Responses API as itself
    assert d("mlxs_http_requests_total", api="runtime", status="200") == 2
    assert d("mlxs_http_requests_total", api="metrics", status="200") == 1  # the first /metrics
    # the engine's counters: /metrics and /api/stats read the same figures
    t, t0 = after["totals"], before["totals"]  # the totals are the process's: other tests' engines ran too
    assert value(m, "mlxs_generations_total") == after["requests_served"]
    assert d("mlxs_generations_total") == after["requests_served"] - before["requests_served"] \
        == t["responses"] - t0["responses"]
    assert value(m, "mlxs_generated_tokens_total") == t["generated_tokens"]
    assert t["generated_tokens"] - t0["generated_tokens"] == after["generated_tokens"] - before["generated_tokens"]
    assert value(m, "mlxs_prompt_tokens_total") == t["prompt_tokens"]
    assert value(m, "mlxs_reused_tokens_total") == t["reused_tokens"]
    assert value(m, "mlxs_prefilled_tokens_total") == t["prefilled_tokens"]
    assert value(m, "mlxs_prefill_seconds_total") == pytest.approx(t["prefill_seconds"])
    assert value(m, "mlxs_decode_seconds_total") == pytest.approx(t["decode_seconds"])
    [loaded] = after["models"]  # the pool and memory figures are each loaded model's, labelled by it
    model = loaded["model"]
    for name, key in (("expert_hits", "hits"), ("expert_misses", "misses"), ("expert_evictions", "evictions"),
                      ("expert_read_bytes", "bytes_read"), ("expert_reads", "reads")):
        assert value(m, f"mlxs_{name}_total", model=model) == after[key] == loaded["counters"][key], name
    assert value(m, "mlxs_host_syncs_total") == after["syncs"]
    # what this sequence added, against what the replies said
    assert t["generated_tokens"] - before["totals"]["generated_tokens"] == tokens_out == 5 + 5 + 4 + 3 + 3 + 2
    assert t["prompt_tokens"] - before["totals"]["prompt_tokens"] == prompt_in
    assert value(m, "mlxs_time_to_first_token_seconds_count") == t["responses"]
    assert value(m, "mlxs_time_to_first_token_seconds_bucket", le="+Inf") == t["responses"]
    assert value(m, "mlxs_time_to_first_token_seconds_sum") == pytest.approx(t["ttft_sum"])
    # gauges
    assert value(m, "mlxs_queue_depth") == 0 and value(m, "mlxs_batch_size") == 0
    assert value(m, "mlxs_model_loaded") == 1
    assert value(m, "mlxs_model_info", model="mlx-stream", checkpoint=after["checkpoint"], state="loaded",
                 policy=after["policy"], store=after["store"]) == 1
    assert value(m, "mlxs_resident_bytes", model=model, part="experts") > 0
    assert value(m, "mlxs_resident_bytes", model=model, part="dense") > 0
    assert value(m, "mlxs_kv_cache_bytes", model=model) > 0
    assert value(m, "mlxs_expert_slots", model=model) == 4 * len(after["layers"])
    assert value(m, "mlxs_model_memory_bytes", model=model) == loaded["memory_bytes"] > 0
    assert value(m, "mlxs_model_loads_total") == after["model_loads"] >= 1


def test_metrics_name_every_figure_the_issue_asks_for(dash):
    names = {name for name, _ in metrics(dash)}
    for name in ("mlxs_http_requests_total", "mlxs_prompt_tokens_total", "mlxs_generated_tokens_total",
                 "mlxs_prefill_seconds_total", "mlxs_decode_seconds_total", "mlxs_time_to_first_token_seconds_bucket",
                 "mlxs_expert_hits_total", "mlxs_expert_misses_total", "mlxs_expert_read_bytes_total",
                 "mlxs_host_syncs_total", "mlxs_queue_depth", "mlxs_batch_size", "mlxs_resident_bytes",
                 "mlxs_kv_cache_bytes", "mlxs_model_info", "mlxs_pipeline_restarts_total"):
        assert name in names, name


# -- the event stream ------------------------------------------------------------------
def test_the_event_stream_sends_frames_only_while_someone_listens(dash):
    feed = app_of(dash).state.feed
    got = frames(dash, 3)
    first, later = got[0], got[2]
    assert first["first"] and not later["first"]
    assert 0.3 <= later["t"] - got[1]["t"] <= 2.0  # at most a few frames a second
    rows = first["heatmap"]["rows"]
    assert rows and all(len(r["resident"]) == r["experts"] == 8 and r["slots"] == 4 for r in rows)
    assert all(r["resident"].count("1") <= 4 for r in rows)
    assert first["memory"]["experts_bytes"] > 0 and first["memory"]["machine_bytes"]
    [row] = first["models"]  # the dashboard's row per loaded model: its share and its memory
    assert row["running"] and row["experts_bytes"] == first["memory"]["experts_bytes"] and row["slots"] == 4 * len(rows)
    assert set(first["server"]) >= {"queued", "running", "max_queue"}
    wait_until(lambda: feed.listeners == 0, timeout=10)
    samples = len(feed.samples)
    import time

    time.sleep(1.2)
    assert len(feed.samples) == samples  # nothing is computed while no page listens


def test_the_heatmap_counts_are_the_pools_own(dash):
    """The first frame's per-expert counts add up to the pools' counters."""
    post(dash, "/v1/chat/completions", {"model": "mlx-stream", "max_tokens": 3,
                                        "messages": [{"role": "user", "content": "count my experts"}]})
    frame = json.loads(request(dash, "GET", "/dashboard/snapshot")[2])
    layers = {str(x["layer"]): x for x in stats(dash)["layers"]}
    for row in frame["heatmap"]["rows"]:
        lookups = sum(n for _, n in row["lookups"])
        misses = sum(n for _, n in row["misses"])
        assert misses == layers[row["name"]]["misses"]
        assert lookups - misses == layers[row["name"]]["hits"]
        assert row["resident"].count("1") == 4


def test_prefill_progress_is_reported_during_a_long_prompt(dash, held_prefill):
    body = {"model": "mlx-stream", "max_tokens": 2, "prefill_step": 32,
            "messages": [{"role": "user", "content": LONG}]}
    thread, out = in_thread(post, dash, "/v1/chat/completions", body)
    assert held_prefill.entered.wait(60)
    flight = stats(dash)["in_flight"]
    assert len(flight) == 1 and flight[0]["phase"] == "prefill"
    assert 0 < flight[0]["prefill_done"] < flight[0]["prefill_total"] <= flight[0]["prompt_tokens"]
    frame = frames(dash, 1)[0]
    assert frame["in_flight"][0]["prefill_done"] == flight[0]["prefill_done"]
    held_prefill.go.set()
    thread.join(60)
    assert out["value"][0] == 200, out
    assert stats(dash)["in_flight"] == []
    assert out["value"][1]["usage"]["prompt_tokens"] == flight[0]["prompt_tokens"]


# -- the key and the guard ---------------------------------------------------------------
def test_the_key_guards_the_stream_the_snapshot_and_metrics_not_the_page(keyed):
    for path in ("/dashboard/events", "/dashboard/snapshot", "/metrics"):
        assert request(keyed, "GET", path)[0] == 401, path
        assert request(keyed, "GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401, path
    assert request(keyed, "GET", "/dashboard/snapshot", headers={"Authorization": "Bearer sesame"})[0] == 200
    assert request(keyed, "GET", "/metrics", headers={"x-api-key": "sesame"})[0] == 200
    assert frames(keyed, 1, headers={"Authorization": "Bearer sesame"})[0]["first"]
    status, _, page = request(keyed, "GET", "/dashboard")
    assert status == 200 and b"dashboard/static/dashboard.js" in page


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/events", "/dashboard/static/dashboard.js", "/metrics",
                                  "/docs", "/dashboard/static/swagger/swagger-ui-bundle.js"])
def test_a_foreign_origin_or_host_is_refused(dash, path):
    status, _, body = request(dash, "GET", path, headers={"Origin": "http://evil.example"})
    assert status == 403 and json.loads(body)["error"]["code"] == "origin_not_allowed"
    status, _, body = request(dash, "GET", path, headers={"Host": "evil.example"})
    assert status == 403 and json.loads(body)["error"]["code"] == "host_not_allowed"


# -- the offline docs -----------------------------------------------------------------------
def test_docs_load_swagger_ui_from_the_package(dash):
    status, _, page = request(dash, "GET", "/docs")
    assert status == 200
    assert b"/dashboard/static/swagger/swagger-ui-bundle.js" in page and b"/dashboard/static/swagger/swagger-ui.css" in page
    assert b"cdn.jsdelivr" not in page and b"https://" not in page.replace(b"https://swagger.io", b"")
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "LICENSE"):
        status, head, body = request(dash, "GET", f"/dashboard/static/swagger/{asset}")
        assert status == 200 and len(body) > 1000, asset
    assert request(dash, "GET", "/redoc")[0] == 404  # not shipped: Swagger UI only
    spec = json.loads(request(dash, "GET", "/openapi.json")[2])
    assert "/metrics" in spec["paths"] and "/dashboard/snapshot" in spec["paths"]
    assert "/dashboard/events" not in spec["paths"]  # endless: no schema-driven client should wait on it


def test_a_one_chunk_prefill_shows_its_progress_through_the_layers(dash, monkeypatch):
    """With the whole prompt in one chunk, progress is the share of MoE layers it has gone through."""
    import threading

    from llm_mlx_streaming.activity import ACTIVITY

    entered, go = threading.Event(), threading.Event()
    real = ACTIVITY.moe_layer

    def moe_layer(ordinal):
        real(ordinal)
        flight = ACTIVITY.prefilling
        if ordinal == 0 and flight is not None and flight.first_token is None and not go.is_set():
            entered.set()
            assert go.wait(60)

    monkeypatch.setattr(ACTIVITY, "moe_layer", moe_layer)
    body = {"model": "mlx-stream", "max_tokens": 2, "prefill_step": 2048,
            "messages": [{"role": "user", "content": LONG + " once more"}]}
    thread, out = in_thread(post, dash, "/v1/chat/completions", body)
    try:
        assert entered.wait(60)
        flight = stats(dash)["in_flight"][0]
        assert flight["prefill_done"] == 0 and flight["layer"] == 1 and flight["layers"] == 2
        chunk = flight["prefill_total"] - 1  # the last prompt token goes with the first decode step
        assert flight["prefill_estimate"] == chunk // 2
    finally:
        go.set()
        thread.join(60)
    assert out["value"][0] == 200, out
