"""Two models served at once over HTTP: requests that alternate between them through the
OpenAI and Ollama routes load nothing after the first of each and answer as each model
alone; /api/ps, /v1/models and /api/stats show both; keep_alive on every API."""

from __future__ import annotations

import calendar
import json
import time
from contextlib import contextmanager

import pytest

from dashboard_support import request
from plugin_support import LlmEnv, assert_ok, serving

PROMPTS = ("name three colours", "count to five")


@contextmanager
def two_models(user_dir, paths, **kwargs):
    """Models 'a' and 'b' (tiny checkpoints) served from one llm user dir; `kwargs` go to the server."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(user_dir))
        env = LlmEnv(user_dir, paths[0])
        env.write_settings(default_model="a", max_context=96, max_batch=1,
                           models={name: {"path": str(p), "expert_slots": 4} for name, p in zip("ab", paths)})
        with serving(env, max_queue=8, **kwargs):
            yield env


def call(env, method, path, body=None) -> tuple[int, dict, dict]:
    status, head, raw = request(env, method, path, body)
    return status, head, json.loads(raw)


def ask(env, api: str, model: str, prompt: str, **extra) -> str:
    """The reply's text through the OpenAI ('openai') or Ollama ('ollama') chat route."""
    messages = [{"role": "user", "content": prompt}]
    if api == "openai":
        status, _, body = call(env, "POST", "/v1/chat/completions", {"model": model, "messages": messages,
                                                                      "max_tokens": 6, **extra})
        assert status == 200, body
        return body["choices"][0]["message"]["content"]
    status, _, body = call(env, "POST", "/api/chat", {"model": model, "messages": messages, "stream": False,
                                                       "options": {"num_predict": 6}, **extra})
    assert status == 200, body
    return body["message"]["content"]


# each loaded model is listed by its first id: 'a' is the default model, 'mlx-stream'
LISTED = {"a": "mlx-stream:latest", "b": "mlx-stream/b:latest"}  # with Ollama's default tag


def loaded(env) -> set[str]:
    """The models /api/ps lists, as 'a' and 'b'."""
    names = {m["name"] for m in call(env, "GET", "/api/ps")[2]["models"]}
    return {short for short, name in LISTED.items() if name in names} | (names - set(LISTED.values()))


@pytest.fixture(scope="module")
def paths(build):
    return [build("qwen3_moe", seed=seed) for seed in (21, 22)]


@pytest.fixture(scope="module")
def alone(tmp_path_factory, paths):
    """Each model's text on each route, served one at a time (max_models 1)."""
    with two_models(tmp_path_factory.mktemp("alone") / "llm", paths, max_models=1) as env:
        return {(api, model, p): ask(env, api, model, p) for model in "ab" for api in ("openai", "ollama")
                for p in PROMPTS}


@pytest.fixture(scope="module")
def both(tmp_path_factory, paths, alone):
    """Both models served at once (after `alone`: the engine, and its max_models, is the process's)."""
    with two_models(tmp_path_factory.mktemp("both") / "llm", paths, max_models=2) as env:
        yield env


def test_alternating_requests_load_each_model_once_and_answer_as_alone(both, alone):
    steps = [(api, model, p) for p in PROMPTS for model in "ab" for api in ("openai", "ollama")]
    got, first_of_each = {}, None
    for i, step in enumerate(steps):
        got[step] = ask(both, *step)
        loads = call(both, "GET", "/api/stats")[2]["model_loads"]  # the process's engine: since its start
        first_of_each = loads if i == 2 else first_of_each
        assert i < 2 or loads == first_of_each, step  # no load after the first request of each model
    assert got == alone
    stats = call(both, "GET", "/api/stats")[2]
    assert [sorted(m["ids"]) for m in stats["models"]] == [["mlx-stream", "mlx-stream/a"], ["mlx-stream/b"]]
    assert sum(m["running"] for m in stats["models"]) == 1
    assert loaded(both) == {"a", "b"}
    cards = {c["id"]: c["loaded"] for c in call(both, "GET", "/v1/models")[2]["data"]}
    assert cards["mlx-stream/a"] is cards["mlx-stream/b"] is cards["mlx-stream"] is True


def test_llm_mlxs_stats_live_shows_each_loaded_model(both):
    ask(both, "openai", "a", PROMPTS[0]), ask(both, "ollama", "b", PROMPTS[0])
    shown = assert_ok(both.run("mlxs", "stats", "--live")).stdout
    assert "loaded models (2 of at most 2" in shown
    rows = [line.split() for line in shown.splitlines() if line.split()[:1] in (["mlx-stream"], ["mlx-stream/b"])]
    assert sorted((r[0], r[1].rstrip(",")) for r in rows) == [("mlx-stream", "waiting"), ("mlx-stream/b", "running")]


def test_keep_alive_on_every_route_times_or_unloads_that_model_only(both):
    ask(both, "openai", "a", PROMPTS[0]), ask(both, "openai", "b", PROMPTS[0])
    status, head, _ = call(both, "POST", "/v1/chat/completions", {
        "model": "b", "messages": [{"role": "user", "content": "bye"}], "max_tokens": 2, "keep_alive": 0})
    assert status == 200 and "keep_alive" not in head.get("x-mlx-stream-ignored", "")
    assert loaded(both) == {"a"}  # b unloaded after its reply, a untouched

    start = time.time()
    status, _, body = call(both, "POST", "/v1/responses", {"model": "b", "input": "hi", "max_output_tokens": 2,
                                                            "keep_alive": "5m"})
    assert status == 200, body
    due = {m["name"]: m["expires_at"] for m in call(both, "GET", "/api/ps")[2]["models"]}
    assert due[LISTED["a"]].startswith("9999")  # the server's keep_alive: -1
    expires = calendar.timegm(time.strptime(due[LISTED["b"]][:19], "%Y-%m-%dT%H:%M:%S"))
    assert start + 290 <= expires <= time.time() + 310

    status, _, body = call(both, "POST", "/v1/messages", {"model": "b", "max_tokens": 2, "keep_alive": -1,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
    assert all(m["expires_at"].startswith("9999") for m in call(both, "GET", "/api/ps")[2]["models"])
    status, _, body = call(both, "POST", "/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 1,
                                                             "keep_alive": "soon"})
    assert status == 400 and "keep_alive" in json.dumps(body)
    assert loaded(both) == {"a", "b"}


def test_llm_mlxs_plan_of_several_models_shows_the_split_the_server_makes(both):
    from llm_mlx_streaming.engine.sharing import claim_of, split
    from llm_mlx_streaming.options.run_config import configure
    from llm_mlx_streaming.options.settings import Options, load_settings

    def planned(budget: str) -> dict:
        return json.loads(assert_ok(both.run("mlxs", "plan", "a", "b", "--budget", budget, "--json")).stdout)

    whole, shared = planned("1GB"), planned("270MB")  # the reserve (256 MiB at least) is counted once
    assert [m["slots_per_layer"] for m in whole["models"]] == [[8, 8], [8, 8]]
    assert [m["slots_per_layer"] for m in shared["models"]] == [[4, 4], [4, 4]]  # each shrunk, above top_k
    runs = [configure(n, Options(memory_budget="270MB"), load_settings()) for n in "ab"]
    assert split(runs[0].load.budget, [claim_of(r.load) for r in runs]) == [(4, 4), (4, 4)]  # the server's split
    assert sum(m["memory_bytes"] for m in shared["models"]) + shared["reserve_bytes"] <= shared["budget"]
    shown = assert_ok(both.run("mlxs", "plan", "a", "b", "--budget", "270MB")).stdout
    assert "shared by 2 models" in shown and len([ln for ln in shown.splitlines() if ln.split()[:1] == ["a"]]) == 1
    refused = both.run("mlxs", "plan", "a", "b", "--budget", "269.5MB")
    assert refused.exit_code == 1 and "do not fit in 269.5 MB at once" in refused.stderr
