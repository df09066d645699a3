"""Claude Code's prompt is read once (#46): the billing line it puts in front of its system
prompt is left out of the prompt (and named as ignored), so its next turn with a new `cch`
nonce and a new session with a new version hash reuse the prompt they share with the last
one, through `/v1/messages`, on plain attention and on a cache that cannot be rewound
(linear attention, served from a snapshot).

The bodies are Claude Code's recorded requests (tests/data/traffic: two `claude -p`
sessions, and a session that believed it spoke to Anthropic's API, whose line carries a
`cch` nonce), each text cut to 500 characters and two tools, so that a prefill takes a
moment on this CPU (a 32k BPE vocabulary, as real models have) so that a prefill takes a moment on this CPU."""

from __future__ import annotations

import copy

import pytest

from fixtures.traffic import load
from server_support import call, send, small_server

def _cut(text: str) -> str:
    return text[:500]


def _recorded(name: str) -> dict:
    """A recorded request cut down the same way every time, its billing line as it was sent."""
    body = copy.deepcopy(load(name)["body"])
    body["system"] = [body["system"][0], *({**block, "text": _cut(block["text"])} for block in body["system"][1:])]
    body["tools"] = [{**tool, "description": _cut(tool["description"])} for tool in body["tools"][:2]]
    for message in body["messages"]:
        if isinstance(message["content"], str):
            message["content"] = _cut(message["content"])
        for block in message["content"] if isinstance(message["content"], list) else ():
            if block["type"] == "text":
                block["text"] = _cut(block["text"])
    body.update(model="small", max_tokens=4, stream=False)
    return body


def _line(body: dict) -> str:
    return body["system"][0]["text"]


def _ask(served, body) -> tuple[dict, dict]:
    status, headers, reply = call(served, "POST", "/v1/messages", body)
    assert status == 200, reply
    return reply, headers


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def served(request, build, tmp_path_factory):
    path = build(request.param, tool_template=True, tokenizer_kind="bpe32k", max_position_embeddings=8192)
    with small_server(tmp_path_factory.mktemp("agent-cache") / "llm", path,
                      settings={"max_context": 4096}) as env:
        env.arch = request.param
        yield env


def test_two_recorded_claude_code_sessions_share_their_prompt_whatever_their_billing_lines(served):
    first, second = _recorded("claude_code_turn1"), _recorded("claude_code_session2_turn1")
    assert _line(first) != _line(second)  # the line's suffix follows the first prompt's text
    reply, headers = _ask(served, first)
    assert "system.x-anthropic-billing-header" in headers["x-mlx-stream-ignored"]
    shared = call(served, "POST", "/v1/messages/count_tokens",
                  {**{k: first[k] for k in ("model", "system", "tools")},
                   "messages": [{"role": "user", "content": "x"}]})[2]["input_tokens"]
    reply, _ = _ask(served, second)  # a new session
    assert reply["usage"]["cache_read_input_tokens"] >= 0.95 * (shared - 8)

    metrics = send(served, "GET", "/metrics")[2].decode()
    source = "memory" if served.arch == "qwen3_moe" else "snapshot"  # plain attention is cut back in place
    metric = 'mlxs_reused_tokens_by_source_total{source="%s"}' % source
    line = next(x for x in metrics.splitlines() if x.startswith(metric))
    assert float(line.split()[-1]) >= reply["usage"]["cache_read_input_tokens"]
    live = served.run("mlxs", "stats", "--live").output
    assert ("prompt snapshots" in live) == (served.arch != "qwen3_moe")  # only where the cache cannot be rewound


def test_a_turn_whose_only_change_is_a_new_cch_nonce_reuses_the_turn_before(served):
    first, following = _recorded("claude_code_first_party_turn1"), _recorded("claude_code_first_party_tool_result")
    assert "cch=" in _line(first) and _line(first) != _line(following)
    reply, _ = _ask(served, first)
    prompt = reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"]
    reply, _ = _ask(served, following)
    assert reply["usage"]["cache_read_input_tokens"] >= 0.9 * prompt


def _reused_from(served, source: str) -> float:
    metric = 'mlxs_reused_tokens_by_source_total{source="%s"}' % source
    lines = [x for x in send(served, "GET", "/metrics")[2].decode().splitlines() if x.startswith(metric)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_the_main_conversation_resumes_from_memory_after_a_side_request_and_a_subagent(served):
    """Claude Code's pattern on one model: its main turn, a side request (a title, on a
    system prompt of its own), a subagent (its own system prompt and tools), then the main
    conversation's next turn, which extends the main turn's cache where memory kept it."""
    main = _recorded("claude_code_first_party_turn1")
    reply, _ = _ask(served, main)
    prompt = reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"]
    _ask(served, {"model": "small", "max_tokens": 4, "stream": False,
                  "system": [{"type": "text", "text": "Write a five-word title for this conversation."}],
                  "messages": [{"role": "user", "content": "Fix the failing test in the parser."}]})
    subagent = _recorded("claude_code_turn1")
    subagent["system"] = [{"type": "text", "text": "You are a file search specialist. " * 20}]
    subagent["tools"] = [{**tool, "description": _cut(tool["description"])} for tool in load("claude_code_turn1")
                         ["body"]["tools"][2:4]]
    _ask(served, subagent)
    following = {**main, "messages": [*main["messages"], {"role": "assistant", "content": reply["content"]},
                                      {"role": "user", "content": "Go on."}]}
    before = _reused_from(served, "memory")
    reply, _ = _ask(served, following)
    assert reply["usage"]["cache_read_input_tokens"] >= prompt
    assert _reused_from(served, "memory") - before == reply["usage"]["cache_read_input_tokens"]


def test_a_system_prompt_given_as_a_string_loses_its_billing_line_too(served):
    body = _recorded("claude_code_first_party_turn1")
    text = "\n".join(block["text"] for block in body["system"])
    as_string = call(served, "POST", "/v1/messages/count_tokens",
                     {"system": text.partition("\n")[2], "messages": body["messages"]})[2]["input_tokens"]
    with_line = call(served, "POST", "/v1/messages/count_tokens",
                     {"system": text, "messages": body["messages"]})
    assert with_line[2]["input_tokens"] == as_string
    assert "system.x-anthropic-billing-header" in with_line[1]["x-mlx-stream-ignored"]
