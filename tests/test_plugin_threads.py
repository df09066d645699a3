"""Threads and llm's Python API: several threads prompting two models at once, and the
async model, which answers on the event loop with no thread of its own."""

import threading
import time

import llm

from test_plugin_features import tools_env  # noqa: F401 (a fixture)


def test_threads_prompting_two_models_each_get_their_own_checkpoint(llm_env, build, monkeypatch):
    from llm_mlx_streaming.reply import build as prompting  # where the reply core calls render_prompt

    other = build("qwen3_moe", seed=7)
    llm_env.write_settings(
        default_model="small",
        models={
            "small": {"path": str(llm_env.checkpoint), "expert_slots": 4},
            "other": {"path": str(other), "expert_slots": 4},
        },
    )
    paths = {"small": str(llm_env.checkpoint), "other": str(other)}
    alone = {name: llm.get_model(f"mlx-stream/{name}").prompt("hello there", max_tokens=6).text()
             for name in paths}
    assert alone["small"] != alone["other"]

    real_render = prompting.render_prompt

    def slow_render(tokenizer, prompt, **options):
        time.sleep(0.05)  # a window in which another thread could swap the model
        return real_render(tokenizer, prompt, **options)

    monkeypatch.setattr(prompting, "render_prompt", slow_render)
    results, errors = [], []

    def ask(name):
        try:
            response = llm.get_model(f"mlx-stream/{name}").prompt("hello there", max_tokens=6)
            results.append((name, response.text(), response.response_json["checkpoint"]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=ask, args=(name,)) for name in ["small", "other"] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 6
    for name, text, checkpoint in results:
        assert checkpoint == paths[name]
        assert text == alone[name]


# -- the async model: the reply core on the event loop --------------------------------

SCRIPTED = '<think>adding</think>Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def add(a: int, b: int) -> int:
    "Add two numbers"
    return a + b


def _logged(response, db_path) -> dict:
    """What llm logs for `response`: its turn and its parts (a call's id is made afresh each time)."""
    import json
    import sqlite3

    import sqlite_utils

    response.log_to_db(sqlite_utils.Database(db_path))
    conn = sqlite3.connect(db_path)
    conn.row_factory = sqlite3.Row
    try:
        turn = dict(conn.execute("select * from turns order by rowid desc limit 1").fetchone())
        parts = [(row["type"], row["tool_name"], row["text"],
                  {k: v for k, v in json.loads(row["payload"] or "{}").items() if k != "tool_call_id"})
                 for row in conn.execute("select * from parts order by rowid")]
    finally:
        conn.close()
    return {"model": turn["model"], "options": turn["options_json"], "input_tokens": turn["input_tokens"],
            "output_tokens": turn["output_tokens"], "parts": parts}


def test_the_async_model_gives_the_sync_models_events_and_holds_no_thread_of_its_own(tools_env, tmp_path):
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    tools_env.script = [SCRIPTED]
    sync = llm.get_model("mlx-stream").prompt("2 + 3?", tools=[add], max_tokens=200)
    sync_events = [(e.type, e.chunk) for e in sync.stream_events()]
    model = llm.get_async_model("mlx-stream")

    async def prompted():
        # AsyncReply reads settings and renders on the loop's executor: one thread, so that
        # after one prompt it is at its full size, and a thread made for a prompt shows
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        tools_env.script = ["warm", SCRIPTED]
        await model.prompt("hi", max_tokens=4).text()  # the engine thread and the executor's have started
        before = set(threading.enumerate())
        during: set = set()
        response = model.prompt("2 + 3?", tools=[add], max_tokens=200)
        events = []
        async for event in response.astream_events():
            events.append((event.type, event.chunk))
            during.update(threading.enumerate())
        return response, events, before, during

    response, events, before, during = asyncio.run(prompted())
    assert during - before == set(), [t.name for t in during - before]  # no thread for this prompt
    assert events == sync_events
    said = {kind: "".join(chunk for k, chunk in events if k == kind) for kind in ("reasoning", "text")}
    assert said == {"reasoning": "adding", "text": "Let me add."} and ("tool_call_name", "add") in events
    calls = asyncio.run(response.tool_calls())
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in sync.tool_calls()] \
        == [("add", {"a": 2, "b": 3})]
    assert (response.input_tokens, response.output_tokens) == (sync.input_tokens, sync.output_tokens)
    figures = ("prompt_tokens", "generated_tokens", "checkpoint")  # reused_tokens: the sync prompt left a cache
    assert {k: response.response_json[k] for k in figures} == {k: sync.response_json[k] for k in figures}
    logged = asyncio.run(response.to_sync_response())
    assert _logged(logged, tmp_path / "async.db") == _logged(sync, tmp_path / "sync.db")
