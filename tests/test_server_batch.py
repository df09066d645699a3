"""`llm mlxs serve` with max_batch 4: concurrent clients are decoded in one batch, each
gets the reply it gets alone, and one that hangs up leaves the others undisturbed."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from server_support import call, small_server, wait_for
from test_server import PROMPTS, chat_body, client, in_thread


@pytest.fixture(scope="module")
def served(tmp_path_factory, plugin_checkpoint):
    with small_server(tmp_path_factory.mktemp("batched") / "llm", plugin_checkpoint, max_batch=4) as env:
        yield env


def _queued(served) -> int:
    return call(served, "GET", "/api/stats")[2]["requests_queued"]


def ask(served, prompt, max_tokens=8):
    reply = client(served).chat.completions.create(
        model="mlx-stream", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
    return reply.choices[0].message.content, reply.model_extra["mlx_stream"]["stats"]


def test_four_openai_clients_share_one_batch_and_get_their_replies_alone(served):
    alone = {p: ask(served, p)[0] for p in PROMPTS}
    go = threading.Event()
    from llm_mlx_streaming.engine import worker

    worker.submit(lambda out: go.wait(60))
    try:
        runs = [in_thread(ask, served, p) for p in PROMPTS]
        wait_for(lambda: _queued(served) == 4)  # all four wait behind the held engine
    finally:
        go.set()
    for t, _ in runs:
        t.join(60)
    replies = [out["value"] for _, out in runs]
    assert [text for text, _ in replies] == [alone[p] for p in PROMPTS]
    assert [stats["batch"] for _, stats in replies] == [4, 4, 4, 4]
    stats = call(served, "GET", "/api/stats")[2]
    assert stats["largest_batch"] == 4 and stats["batch"] == 0
    assert stats["unplaced"] == 0 and stats["syncs_per_token"] is not None


def test_a_client_that_hangs_up_leaves_the_batch_and_the_others_go_on(served, monkeypatch):
    from llm_mlx_streaming.engine.batch import Batch
    from llm_mlx_streaming.engine.manager import get_manager

    others = PROMPTS[:3]
    alone = {p: ask(served, p, max_tokens=30)[0] for p in others}
    hung_up = threading.Event()
    step = Batch.step

    def held_until_the_client_goes(self):
        # the long reply's third token is out: nobody moves on until its client has gone
        if any(m.request.max_tokens == 60 and m.tokens >= 3 for m in self.members.values()):
            assert hung_up.wait(60)
        return step(self)

    monkeypatch.setattr(Batch, "step", held_until_the_client_goes)
    gone = call(served, "GET", "/api/stats")[2]["server"]["disconnects"]
    served_before = get_manager().served
    go = threading.Event()
    from llm_mlx_streaming.engine import worker

    worker.submit(lambda out: go.wait(60))
    try:
        sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=60)
        body = json.dumps(chat_body("go on and on", max_tokens=60, stream=True)).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: _queued(served) == 1)
        runs = [in_thread(ask, served, p, 30) for p in others]
        wait_for(lambda: _queued(served) == 4)
    finally:
        go.set()
    received = b""
    while received.count(b"data:") < 3:
        received += sock.recv(4096)
    sock.close()
    wait_for(lambda: call(served, "GET", "/api/stats")[2]["server"]["disconnects"] == gone + 1)
    hung_up.set()
    for t, _ in runs:
        t.join(60)
    assert [out["value"][0] for _, out in runs] == [alone[p] for p in others]
    assert [out["value"][1]["batch"] for _, out in runs] == [4, 4, 4]
    assert get_manager().served == served_before + 3  # the cut reply never ran to its end
    assert get_manager().bad_slots() == 0
