"""Two models served at once over HTTP: requests that alternate between them through the
OpenAI and Ollama routes load nothing after the first of each and answer as each model
alone; /api/ps, /v1/models and /api/stats show both; keep_alive on every API, counted from
the end of the reply; a configuration change for every model or one; the server's budget
not re-split by a request's; a stopped server's pins left behind."""

from __future__ import annotations

import calendar
import http.client
import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from dashboard_support import request
from plugin_support import LlmEnv, assert_ok, serving
from server_support import wait_for

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
IDS = {"a": "mlx-stream", "b": "mlx-stream/b"}
LISTED = {short: model_id + ":latest" for short, model_id in IDS.items()}  # /api/ps: with Ollama's default tag


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
    assert split(runs[0].shared_budget, [claim_of(r.load) for r in runs]) == [(4, 4), (4, 4)]  # the server's split
    assert sum(m["memory_bytes"] for m in shared["models"]) + shared["reserve_bytes"] <= shared["budget"]
    shown = assert_ok(both.run("mlxs", "plan", "a", "b", "--budget", "270MB")).stdout
    assert "shared by 2 models" in shown and len([ln for ln in shown.splitlines() if ln.split()[:1] == ["a"]]) == 1
    refused = both.run("mlxs", "plan", "a", "b", "--budget", "269.5MB")
    assert refused.exit_code == 1 and "do not fit in 269.5 MB at once" in refused.stderr


# -- keep_alive from the reply's end (issue 57) ---------------------------------------------


class Pause:
    """A logits processor that holds its generation at its fourth token (the first two have
    been given out: mlx-lm computes a token ahead) until `go` is set."""

    def __init__(self) -> None:
        self.calls, self.reached, self.go = 0, threading.Event(), threading.Event()

    def __call__(self, tokens, logits):
        self.calls += 1
        if self.calls == 4:
            self.reached.set()
            self.go.wait(10)
        return logits


@contextmanager
def paused_generations(path, text: str):
    """Each generation the engine runs meanwhile replies `text` (words: each token's text
    goes out at once) and holds at its fourth token (yields the pauses)."""
    from mlx_lm.tokenizer_utils import load

    from fixtures.scripted import Force
    from llm_mlx_streaming.engine.manager import get_manager

    tokenizer = load(Path(path))
    script = tokenizer.encode(text, add_special_tokens=False) + list(tokenizer.eos_token_ids)[:1]
    engine, pauses = get_manager(), []
    real = engine.run

    def run(load_, request_):
        pauses.append(Pause())
        request_.logits_processors.extend([Force(script), pauses[-1]])
        return real(load_, request_)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "run", run)
        try:
            yield pauses
        finally:
            for pause in pauses:
                pause.go.set()


def in_thread(fn, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)), daemon=True)
    thread.start()
    return thread, out


def streamed_lines(env, body: dict, first: threading.Event) -> list:
    """An Ollama /api/chat stream's lines, read as they come; `first` is set at the first."""
    conn = http.client.HTTPConnection("127.0.0.1", env.server.port, timeout=60)
    try:
        conn.request("POST", "/api/chat", json.dumps(body), {"Content-Type": "application/json"})
        resp, lines = conn.getresponse(), []
        while line := resp.readline():
            lines.append(json.loads(line))
            first.set()
        return lines
    finally:
        conn.close()


def expiry(env, model: str):
    """When /api/stats says `model` ('a' or 'b') is unloaded for idleness (None: until told)."""
    return next(m["expires_at"] for m in call(env, "GET", "/api/stats")[2]["models"] if m["model"] == IDS[model])


def test_a_streamed_reply_that_decodes_longer_than_its_keep_alive_keeps_its_model_from_its_end(both, paths):
    ask(both, "openai", "a", PROMPTS[0]), ask(both, "openai", "b", PROMPTS[0])
    first = threading.Event()
    with paused_generations(paths[1], "one two three four five six seven eight") as pauses:
        streamed, out = in_thread(streamed_lines, both, {
            "model": "b", "stream": True, "keep_alive": 1, "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 40}}, first)
        wait_for(lambda: pauses and pauses[0].reached.is_set())
        assert first.wait(10)  # the reply has started: its first frames are with the client
        time.sleep(1.3)  # longer than its keep_alive, the reply still decoding
        assert loaded(both) == {"a", "b"}
        pauses[0].go.set()
        streamed.join(30)
    ended = time.time()
    assert out["value"][-1]["done"] and "eight" in "".join(line["message"]["content"] for line in out["value"])
    assert loaded(both) == {"a", "b"}
    assert expiry(both, "b") >= ended + 0.5  # one second from the reply's end, not from its first frame
    wait_for(lambda: loaded(both) == {"a"}, timeout=10)


def test_a_request_for_a_model_cancels_its_unload_waiting_in_the_engines_queue(both):
    from llm_mlx_streaming.engine import worker
    from llm_mlx_streaming.engine.manager import get_manager

    ask(both, "openai", "a", PROMPTS[0])
    ask(both, "ollama", "b", PROMPTS[0], keep_alive=0.2)
    loads = call(both, "GET", "/api/stats")[2]["model_loads"]
    busy, release = threading.Event(), threading.Event()
    worker.submit(lambda out: (busy.set(), release.wait(10)))  # the engine busy, as with another model's long reply
    try:
        assert busy.wait(10)
        wait_for(lambda: len(worker._engine_thread()._jobs) >= 1)  # b's unload waits in the engine's queue
        gate = both.server.service.turns.gate
        asked, out = in_thread(ask, both, "openai", "b", PROMPTS[1])
        wait_for(lambda: get_manager().queued + gate.waiting >= 1)  # the request for b waits behind it
    finally:
        release.set()
    asked.join(30)
    assert out["value"] and loaded(both) == {"a", "b"}
    assert call(both, "GET", "/api/stats")[2]["model_loads"] == loads  # b never left


# -- a configuration change with several models loaded (issue 57) ----------------------------


def slots(env) -> dict:
    """Each loaded model's expert slots and the options set for it, by 'a' and 'b', from /api/ps."""
    names = {v: k for k, v in LISTED.items()}
    return {names[m["name"]]: (m["expert_slots"], m.get("options")) for m in call(env, "GET", "/api/ps")[2]["models"]}


def test_a_pool_change_applies_to_every_loaded_model_or_to_the_one_named(both):
    ask(both, "openai", "a", PROMPTS[0]), ask(both, "openai", "b", PROMPTS[0])
    try:
        status, _, shown = call(both, "POST", "/api/engine/config", {"expert_slots": 3})
        assert status == 200 and shown["expert_slots"] == 3
        wait_for(lambda: not call(both, "GET", "/api/stats")[2]["rebuilding"])
        assert slots(both) == {"a": (3, {"expert_slots": 3}), "b": (3, {"expert_slots": 3})}

        status, _, shown = call(both, "POST", "/api/engine/config?model=a", {"expert_slots": 2, "policy": "lru"})
        assert status == 200 and shown["expert_slots"] == 2 and shown["policy"] == "lru"
        wait_for(lambda: not call(both, "GET", "/api/stats")[2]["rebuilding"])
        assert slots(both) == {"a": (2, {"expert_slots": 2, "policy": "lru"}), "b": (3, {"expert_slots": 3})}
        assert call(both, "GET", "/api/engine/config?model=b")[2]["policy"] != "lru"
        ask(both, "openai", "a", PROMPTS[1])
        assert call(both, "GET", "/api/stats")[2]["policy"] == "lru"
        ask(both, "ollama", "b", PROMPTS[1])
        assert call(both, "GET", "/api/stats")[2]["policy"] != "lru"
    finally:
        call(both, "POST", "/api/engine/config?model=a", {"expert_slots": None, "policy": None})
        call(both, "POST", "/api/engine/config", {"expert_slots": None})
        wait_for(lambda: not call(both, "GET", "/api/stats")[2]["rebuilding"])
    assert slots(both) == {"a": (4, {}), "b": (4, {})}


def test_llm_mlxs_config_names_the_model_a_change_applies_to(both):
    ask(both, "openai", "a", PROMPTS[0]), ask(both, "openai", "b", PROMPTS[0])
    try:
        done = assert_ok(both.run("mlxs", "config", "expert_slots", "3", "--model", "b"))
        assert "expert_slots = 3 applied to mlx-stream/b on the server at" in done.stderr
        wait_for(lambda: not call(both, "GET", "/api/stats")[2]["rebuilding"])
        assert slots(both) == {"a": (4, {}), "b": (3, {"expert_slots": 3})}
        assert "expert_slots" not in both.read_settings()  # the settings file keeps every model's value
        refused = both.run("mlxs", "config", "expert_slots", "3", "--model", "nonesuch")
        assert refused.exit_code == 1 and "nonesuch" in refused.stderr
    finally:
        call(both, "POST", "/api/engine/config?model=b", {"expert_slots": None})
        wait_for(lambda: not call(both, "GET", "/api/stats")[2]["rebuilding"])


# -- the budget is the server's (issue 57) ----------------------------------------------------


def test_a_request_with_its_own_memory_budget_does_not_re_split_the_others(both):
    try:
        assert call(both, "POST", "/api/engine/config", {"memory_budget": "270MB"})[0] == 200
        wait_for(lambda: not call(both, "GET", "/api/stats")[2]["rebuilding"])
        ask(both, "openai", "a", PROMPTS[0]), ask(both, "openai", "b", PROMPTS[0])
        shared = {name: held for name, (held, _) in slots(both).items()}
        assert shared == {"a": [4, 4], "b": [4, 4]}  # the server's 270 MB split in two
        ask(both, "openai", "a", PROMPTS[1], memory_budget="1GB")
        assert {name: held for name, (held, _) in slots(both).items()} == shared  # a's budget was a's alone
        assert call(both, "GET", "/api/stats")[2]["models"][0]["memory_budget_bytes"] == 270 * 10**6
    finally:
        call(both, "POST", "/api/engine/config", {"memory_budget": None})
        wait_for(lambda: not call(both, "GET", "/api/stats")[2]["rebuilding"])


# -- a stopped server in a process that goes on (issue 57) ----------------------------------


STOPPED = """if True:
    import sys
    from llm_mlx_streaming.engine.manager import get_manager
    from llm_mlx_streaming.engine.request import Request
    from llm_mlx_streaming.options.run_config import configure
    from llm_mlx_streaming.options.settings import Options, load_settings
    from llm_mlx_streaming.server.process.run import Server

    with Server(port=0, model="a", max_models=1):  # a pinned, as `llm mlxs serve -m a` pins it
        list(get_manager().run(configure("a", Options(), load_settings()).load, Request(prompt=[5, 6, 7],
                                                                                     max_tokens=2)))
    load = configure("b", Options(), load_settings()).load  # the process goes on, without the server
    tokens = [r.token for r in get_manager().run(load, Request(prompt=[5, 6, 7], max_tokens=2))]
    print(len(tokens), get_manager().checkpoint.name)
"""


def test_a_process_that_stopped_its_server_loads_another_model_in_place_of_the_pinned_one(tmp_path, paths):
    user_dir = tmp_path / "llm"
    env = LlmEnv(user_dir, paths[0])
    env.write_settings(default_model="a", max_context=96,
                       models={name: {"path": str(p), "expert_slots": 4} for name, p in zip("ab", paths)})
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", STOPPED], capture_output=True, text=True, timeout=120,
                          env={"LLM_USER_PATH": str(user_dir), "PYTHONPATH": str(root), "PATH": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == f"2 {paths[1].name}"
