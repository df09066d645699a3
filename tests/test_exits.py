"""Every process that loaded the engine ends with its own exit status: a script on llm's
Python API (sync and async, a schema, a stream left half read) and `llm mlxs serve`
stopped by SIGINT or SIGTERM after agent traffic (Claude Code's and Codex's recorded
requests, streamed, some cut short), during a prefill, or during concurrent agent
prefills batched together, two abandoned by their clients, one stalled on the disk. None
may end in "terminate called without an active exception" (SIGABRT, the engine thread
killed mid-step as the interpreter finalizes, engine/worker.py); the server's conversation
cache and llm's logs.db are left whole, and a server stops within STOP_SECONDS."""

from __future__ import annotations

import copy
import http.client
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import llm
import pytest

from fixtures.traffic import load
from plugin_support import LlmEnv
from server_support import wait_for

ABNORMAL = ("terminate called", "Traceback", "Fatal Python error")
STOP_SECONDS = 5.0  # from the signal to the server's exit, whatever it was doing (docs/server.md)

# a disk that stalls once: the expert read begun after the file FLAG appears takes a
# minute (FLAG.began says it has begun), longer than an exit may wait
STALL_NEXT_READ = """\
import time
from pathlib import Path
from llm_mlx_streaming.experts.store import ExpertStore

flag, read = Path(FLAG), ExpertStore.read

def stalled(self, jobs, verify=None):
    if flag.exists():
        flag.unlink()
        Path(f"{flag}.began").touch()
        time.sleep(60)
    return read(self, jobs, verify)

ExpertStore.read = stalled
"""

# `llm mlxs serve` on that disk, FLAG being argv[1]
STALLING = f"""\
import sys
from llm.cli import cli
FLAG = sys.argv[1]
{STALL_NEXT_READ}
sys.argv = ["llm", "mlxs", "serve", "--port", "0", "--any-model"]
cli()
"""

SCRIPT = """\
import asyncio, json, sys
import llm

model, later = llm.get_model("mlx-stream"), llm.get_async_model("mlx-stream")
shaped = model.prompt("a person", schema=llm.schema_dsl("name, age int"), max_tokens=40).text()
said = model.prompt("hello", max_tokens=4).text()

async def prompted():
    heard = await later.prompt("hello", max_tokens=4).text()
    async for _ in later.prompt("hello", max_tokens=2000):
        break  # left after its first chunk: the engine is still generating as the script ends
    return heard

print(json.dumps([json.loads(shaped), said, asyncio.run(prompted())]))
sys.exit(int(sys.argv[1]))
"""


def test_a_script_on_the_sync_and_async_models_exits_with_its_own_status(llm_env, tmp_path):
    expected = llm.get_model("mlx-stream").prompt("hello", max_tokens=4).text()
    script = tmp_path / "prompts.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "LLM_USER_PATH": str(llm_env.user_dir)}
    for status in (0, 3, 0):  # each run ended in SIGABRT 9 times in 10 before the engine thread was stopped
        run = subprocess.run([sys.executable, str(script), str(status)], env=env, capture_output=True, text=True,
                             timeout=120)
        said = run.stdout + run.stderr
        assert run.returncode == status and not any(sign in said for sign in ABNORMAL), said
        person, text, async_text = json.loads(run.stdout)
        assert set(person) == {"name", "age"} and text == async_text == expected


ENDING = """\
import os, sys, threading, time
from pathlib import Path
from llm_mlx_streaming.engine import worker

out, began = Path(sys.argv[1]), threading.Event()

def stuck(channel):  # a step that outlasts the wait, halfway through a write that must be whole
    with worker.whole_write():
        began.set()
        partial = out.with_suffix(".partial")
        partial.write_text("half")
        time.sleep(worker.END_WAIT_SECONDS + 1)
        partial.write_text("whole")
        os.replace(partial, out)
    time.sleep(600)

worker.submit(stuck)
began.wait(30)
print("ending", end="")  # left in the buffer: the exit flushes it
worker.end_process(7)
"""


def test_a_process_ended_while_the_engine_is_stuck_finishes_its_write_and_keeps_its_status(tmp_path):
    """engine/worker.end_process (a stopped server's end): a step that outlasts the wait
    is not waited for, nor torn down by the interpreter's finalization; the process ends
    with its own status once the file being written is renamed into place."""
    out = tmp_path / "cache.safetensors"
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", ENDING, str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 7 and run.stdout == "ending" and not any(s in run.stderr for s in ABNORMAL), run
    assert out.read_text() == "whole" and not out.with_suffix(".partial").exists()
    assert time.monotonic() - started < 30  # not the step's 600 s


# -- the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_checkpoint(build):
    """test_agent_traffic's checkpoint: tool template, a 32k tokenizer, a 32k context."""
    return build("qwen3_moe", tool_template=True, tokenizer_kind="bpe32k", max_position_embeddings=32768)


@pytest.fixture
def served(tmp_path, monkeypatch, agent_checkpoint):
    """An llm user dir, and `start(**settings)`: `llm mlxs serve` on a free loopback port in
    a subprocess, serving the agent checkpoint with these settings; (process, discovery info)."""
    from llm_mlx_streaming import discovery

    user_dir = tmp_path / "llm"
    monkeypatch.setenv("LLM_USER_PATH", str(user_dir))
    env = LlmEnv(user_dir, agent_checkpoint)
    processes = []

    def start(stall=None, slots=8, **settings):
        """`stall`: a file whose appearance stalls the next expert read (STALLING)."""
        env.write_settings(default_model="tiny", max_context=32768, **settings,
                           models={"tiny": {"path": str(agent_checkpoint), "expert_slots": slots}})
        llm_bin = os.path.join(os.path.dirname(sys.executable), "llm")
        command = ([sys.executable, "-c", STALLING, str(stall)] if stall is not None
                   else [llm_bin, "mlxs", "serve", "--port", "0", "--any-model"])
        process = subprocess.Popen(command,
                                   env={**os.environ, "LLM_USER_PATH": str(user_dir)},
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        processes.append(process)
        wait_for(lambda: discovery.read() is not None or process.poll() is not None, timeout=60)
        info = discovery.read()
        assert info is not None and info.pid == process.pid, process.stderr.read()
        return process, info

    env.start = start
    yield env
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def _cut(name: str) -> dict:
    """A recorded request made cheap to prefill: its first tools, its long texts cut
    short, a few tokens to generate; still streamed, in its own API's shape."""
    doc = copy.deepcopy(load(name))
    body = doc["body"]
    body["tools"] = body["tools"][:3]
    for block in body.get("system") or []:
        block["text"] = block["text"][:1500]
    for item in body.get("input") or []:
        for part in item.get("content") or []:
            if isinstance(part, dict) and "text" in part:
                part["text"] = part["text"][:1500]
    body["max_output_tokens" if "input" in body else "max_tokens"] = 8
    return doc


def _post(info, doc: dict, connection=None) -> http.client.HTTPConnection:
    """Send `doc` as its client did (on `connection`, kept alive, if given)."""
    conn = connection or http.client.HTTPConnection(info.host, info.port, timeout=120)
    headers = {k: v for k, v in doc["headers"].items() if k not in ("authorization", "x-api-key", "content-length")}
    conn.request(doc["method"], doc["path"], body=json.dumps(doc["body"]), headers=headers)
    return conn


def _reply(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
    response = conn.getresponse()
    assert response.status == 200, response.read()[:300]
    return response


def _events(response, count=None) -> list[str]:
    """The stream's `data:` lines: `count` of them, or all."""
    lines = []
    while count is None or len(lines) < count:
        line = response.readline()
        if not line:
            break
        if line.startswith(b"data:"):
            lines.append(line.decode())
    return lines


def _stats(info) -> dict:
    stats = http.client.HTTPConnection(info.host, info.port, timeout=30)
    stats.request("GET", "/api/stats", headers={"Authorization": f"Bearer {info.secret}"})
    try:
        return json.loads(stats.getresponse().read())
    finally:
        stats.close()


def _prefilling(info, count=1) -> bool:
    """Whether the server is prefilling `count` prompts at once, each with expert work
    done (a prompt in one call counts its MoE layers' progress: `prefill_estimate`)."""
    flights = _stats(info)["in_flight"]
    return sum(f["phase"] == "prefill" and f["prefill_estimate"] > 0 for f in flights) >= count


def _stopped(process, stop_signal: str) -> float:
    """Signal the server: it exits 0, saying it stopped, and nothing else went wrong;
    the seconds from the signal to its exit."""
    process.send_signal(getattr(signal, stop_signal))
    sent = time.monotonic()
    try:
        status = process.wait(20)
    except Exception:
        import subprocess as sp
        open("/tmp/spy.txt", "w").write(sp.run(["/work/main/.venv/bin/py-spy", "dump", "--pid", str(process.pid)], capture_output=True, text=True).stdout)
        raise
    seconds = time.monotonic() - sent
    said = process.stderr.read()
    assert status == 0 and not any(sign in said for sign in ABNORMAL), (status, said)
    assert "server stopped" in said
    return seconds


def _left_whole(user_dir) -> int:
    """The conversation cache's files all readable, none half written; their count."""
    from llm_mlx_streaming.engine.cache_files import saved_header

    files = list((user_dir / "mlx-streaming").glob("kv-cache/**/*.safetensors"))
    assert not [f for f in files if f.name.startswith(".partial-")]
    assert all(saved_header(f) is not None for f in files)
    return len(files)


@pytest.mark.parametrize("stop_signal", ["SIGINT", "SIGTERM"])
def test_a_server_stopped_after_agent_traffic_exits_cleanly(served, stop_signal):
    from llm_mlx_streaming import discovery

    process, info = served.start()
    alive = None  # the whole ones on one connection, kept alive, as the agents' HTTP clients do
    for name, whole in (("claude_code_turn1", True), ("codex_turn1", False), ("claude_code_turn2", True),
                        ("codex_turn1", True), ("claude_code_turn1", False)):
        conn = _post(info, _cut(name), alive if whole else None)
        response = _reply(conn)
        if whole:
            assert json.loads(_events(response)[-1][5:])["type"] in ("message_stop", "response.completed")
            alive = conn
        else:
            assert _events(response, 2)  # then the client goes away mid-stream
            conn.close()
    result = served.run("-m", "mlx-stream", "-o", "max_tokens", "4", "hi")  # llm's own client, logged in logs.db
    assert result.exit_code == 0, result.output
    # the last, Codex's whole request (9,000 tokens), is cancelled during its prefill, and the
    # signal comes at once: the engine is still in the chunk it had begun
    doc = load("codex_turn1")
    doc["body"]["max_output_tokens"] = 8
    conn = _post(info, doc)
    wait_for(lambda: _prefilling(info), timeout=60)
    conn.close()
    assert _stopped(process, stop_signal) < STOP_SECONDS  # the kept-alive connection still open
    assert discovery.read() is None
    assert _left_whole(served.user_dir) >= 1
    db = sqlite3.connect(served.user_dir / "logs.db")
    assert db.execute("pragma integrity_check").fetchone() == ("ok",)
    [(stats,)] = db.execute("select response_json from turns").fetchall()
    assert json.loads(stats)["served_by"] == info.url


def test_a_server_stopped_during_a_prefill_exits_cleanly(served):
    """SIGINT while the longest recorded request (Claude Code's, 19,700 tokens) is being
    prefilled, its client waiting on the stream: the stream ends with an error saying
    the server stops, and the prefill stops at its next chunk."""
    process, info = served.start()
    doc = load("claude_code_sonnet_turn1")
    doc["body"]["max_tokens"] = 8
    conn = _post(info, doc)
    wait_for(lambda: _prefilling(info), timeout=60)
    assert _stopped(process, "SIGINT") < STOP_SECONDS
    last = json.loads(_events(_reply(conn))[-1][5:])
    assert last["type"] == "error" and "the server is stopping" in last["error"]["message"]
    conn.close()
    _left_whole(served.user_dir)


def _read_out(conn) -> None:
    """A client that waits for its reply to the end, however the server ends it."""
    try:
        conn.getresponse().read()
    except (OSError, http.client.HTTPException):
        pass


@pytest.mark.parametrize("stop_signal", ["SIGINT", "SIGTERM"])
def test_a_server_stopped_during_concurrent_agent_prefills_exits_cleanly(served, stop_signal, tmp_path):
    """Issue 50's pattern, cut down: three agent requests for one batch (a small prefill
    step, so each prompt takes many chunks; 2 expert slots, so each chunk reads experts),
    the first prefilled while the other two wait to join it (a member's prompt is fed
    before it joins: engine/batch.py), those two abandoned by their clients, then the
    signal while the first is prefilled. In the runs with a stalled disk the engine is still in its chunk when the
    exit's wait is over (as a long chunk on a slow disk would be); it ended in SIGABRT or
    took as long as the chunk before the exit stopped waiting for it (engine/worker.py)."""
    from llm_mlx_streaming import discovery

    for run, stall in enumerate((True, False, True), 1):
        flag = tmp_path / f"stall{run}"
        process, info = served.start(stall=flag, slots=2, max_batch=3, prefill_step=32)
        result = served.run("-m", "mlx-stream", "-o", "max_tokens", "4", "hi")  # logged in logs.db
        assert result.exit_code == 0, result.output
        whole = load("claude_code_sonnet_turn1")  # 19,700 tokens: still in its prefill at the signal
        whole["body"]["max_tokens"] = 8
        reader = threading.Thread(target=_read_out, args=(_post(info, whole),), daemon=True)
        reader.start()
        wait_for(lambda: _prefilling(info), timeout=60)
        left = [_post(info, _cut(name)) for name in ("codex_turn1", "claude_code_turn2")]
        wait_for(lambda: _stats(info)["requests_queued"] == 2, timeout=60)
        for conn in left:  # their clients go away while they wait to join
            conn.close()
        wait_for(lambda: _stats(info)["server"]["disconnects"] == 2, timeout=30)
        if stall:
            flag.touch()
            wait_for(lambda: os.path.exists(f"{flag}.began"), timeout=30)
        assert _prefilling(info)
        assert _stopped(process, stop_signal) < STOP_SECONDS
        reader.join(30)
        assert discovery.read() is None
        _left_whole(served.user_dir)
        db = sqlite3.connect(served.user_dir / "logs.db")
        assert db.execute("pragma integrity_check").fetchone() == ("ok",)
        assert db.execute("select count(*) from turns").fetchone() == (run,)
        db.close()
