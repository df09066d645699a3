"""Claude Code's prompt is read once (#46): the billing line it puts in front of its system
prompt is left out of the prompt (and named as ignored), so its next turn with a new `cch`
nonce and a new session with a new version hash reuse the prompt they share with the last
one, through `/v1/messages`, on plain attention and on a cache that cannot be rewound
(linear attention, served from a snapshot).

The bodies are Claude Code's recorded first request (tests/data/traffic), cut down to a
~1k-token system prompt and two tools (a 32k BPE vocabulary, as real models have) so that a prefill takes a moment on this CPU."""

from __future__ import annotations

import copy

import pytest

from fixtures.traffic import load
from server_support import call, send, small_server

LINE = "x-anthropic-billing-header: cc_version=2.1.332.{version}; cc_entrypoint=cli; cch={nonce};"


def _body(version: str, nonce: str, messages: list) -> dict:
    recorded = load("claude_code_turn1")["body"]
    body = copy.deepcopy(recorded)
    body["system"] = [{"type": "text", "text": LINE.format(version=version, nonce=nonce)},
                      *({**block, "text": block["text"][:500]} for block in recorded["system"][1:])]
    body["tools"] = [{**tool, "description": tool["description"][:400]} for tool in recorded["tools"][:2]]
    body.update(model="small", messages=messages, max_tokens=4, stream=False)
    return body


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


def test_claude_codes_next_turn_and_new_session_reuse_the_prompt_they_share(served):
    task = [{"role": "user", "content": "List the files in the current directory (use a tool), then say done."}]
    first, headers = _ask(served, _body("307", "a1b2c", task))
    assert "system.x-anthropic-billing-header" in headers["x-mlx-stream-ignored"]
    prompt = first["usage"]["input_tokens"]

    turn = [*task, {"role": "assistant", "content": first["content"] or [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": "Thanks. Now say goodbye in one word."}]
    following, _ = _ask(served, _body("307", "f00d5", turn))  # interactive: a new nonce on every request
    assert following["usage"]["cache_read_input_tokens"] >= 0.9 * prompt

    status, _, system_only = call(served, "POST", "/v1/messages/count_tokens",
                                  {k: v for k, v in _body("1c9", "", [{"role": "user", "content": "x"}]).items()
                                   if k in ("system", "tools", "messages", "model")})
    shared = system_only["input_tokens"]
    fresh = [{"role": "user", "content": "Show the current date (use a tool), then say done."}]
    session, _ = _ask(served, _body("344", "9e8d7", fresh))  # a new session: a new version hash
    assert session["usage"]["cache_read_input_tokens"] >= 0.95 * (shared - 8)

    metrics = send(served, "GET", "/metrics")[2].decode()
    source = "memory" if served.arch == "qwen3_moe" else "snapshot"  # plain attention is cut back in place
    metric = 'mlxs_reused_tokens_by_source_total{source="%s"}' % source
    line = next(x for x in metrics.splitlines() if x.startswith(metric))
    assert float(line.split()[-1]) >= session["usage"]["cache_read_input_tokens"]


def test_a_system_prompt_given_as_a_string_loses_its_billing_line_too(served):
    body = _body("307", "a1b2c", [{"role": "user", "content": "hi"}])
    text = "\n".join(block["text"] for block in body["system"])
    as_string = call(served, "POST", "/v1/messages/count_tokens",
                     {"system": text.partition("\n")[2], "messages": body["messages"]})[2]["input_tokens"]
    with_line = call(served, "POST", "/v1/messages/count_tokens",
                     {"system": text, "messages": body["messages"]})
    assert with_line[2]["input_tokens"] == as_string
    assert "system.x-anthropic-billing-header" in with_line[1]["x-mlx-stream-ignored"]
