"""The recorded client traffic in tests/data/traffic/ (tools/recorder/): what
each recording holds, that it was scrubbed, its size, and its size in tokens with the
realistic tokenizer. The replay of these requests against the server is elsewhere."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from fixtures import traffic

ROOT = Path(__file__).resolve().parents[1]
KEY_TURNS = {
    "claude_code": ["claude_code_turn1", "claude_code_tool_result", "claude_code_turn2"],
    "codex": ["codex_turn1", "codex_tool_output", "codex_turn2"],
    "openai_agents": ["openai_agents_turn1", "openai_agents_tool_output"],
}
KEPT_HEADERS = re.compile(r"^(anthropic-|content-type$|accept$|user-agent$|x-stainless-|x-codex-|openai-"
                          r"|x-app$|x-claude-code-|x-claude-1p-|originator$|session-id$|thread-id$|x-client-request-id$"
                          r"|authorization$|x-api-key$)")
UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def all_docs():
    return {name: traffic.load(name) for name in traffic.names()}


def test_the_key_turns_were_recorded_with_their_client_versions():
    docs = all_docs()
    for client, names in KEY_TURNS.items():
        for name in names:
            doc = docs[name]
            assert doc["client"] == client and re.fullmatch(r"\d+\.\d+\.\d+", doc["client_version"])
            assert doc["method"] == "POST"
    assert docs["claude_code_turn1"]["path"] == "/v1/messages?beta=true"
    assert docs["codex_turn1"]["path"] == "/v1/responses"


def test_each_turn_carries_what_it_should():
    claude = traffic.load("claude_code_turn1")["body"]
    assert {"Bash", "Read"} <= {t["name"] for t in claude["tools"]}
    assert claude["stream"] and claude["max_tokens"] and claude["thinking"]
    # the tool round trip: Claude Code ran the scripted `ls` and sent its output back
    result = traffic.load("claude_code_tool_result")["body"]["messages"][-1]["content"][0]
    assert result["type"] == "tool_result" and "README.md" in result["content"]
    # the later turn (claude -p --continue) repeats the whole first turn: the same text,
    # though cache_control moves to the newest message and a block list may become a string
    later = traffic.load("claude_code_turn2")
    assert [m["role"] for m in later["body"]["messages"]].count("assistant") == 2
    first = traffic.chat_view(traffic.load("claude_code_tool_result"))
    assert traffic.chat_view(later)[0][: len(first[0])] == first[0] and traffic.chat_view(later)[1] == first[1]

    tool_output = traffic.load("codex_tool_output")["body"]
    assert tool_output["input"][-1]["type"] == "function_call_output"
    assert "README.md" in tool_output["input"][-1]["output"]
    # codex exec resume: store false, so no previous_response_id, the whole history again
    later = traffic.load("codex_turn2")["body"]
    assert later["store"] is False and "previous_response_id" not in later
    assert later["input"][: len(tool_output["input"])] == tool_output["input"]
    assert later["prompt_cache_key"] == tool_output["prompt_cache_key"]
    # openai-agents chains with previous_response_id when asked to
    chained = traffic.load("openai_agents_chained_tool_output")["body"]
    assert chained["previous_response_id"] and chained["input"][0]["type"] == "function_call_output"


def test_scrubbed():
    for name, doc in all_docs().items():
        text = json.dumps(doc)
        for bad in ("/tmp/record-agents", "/root/", "-tmp-record-agents", "sk-ant-recorder",
                    "sk-recorder", "recorder-dummy", str(ROOT)):
            assert bad not in text, (name, bad)
        for uuid in UUID.findall(text):
            assert uuid.startswith("00000000-0000-4000-8000-"), (name, uuid)
        for header, value in doc["headers"].items():
            assert header == header.lower() and KEPT_HEADERS.match(header), (name, header)
            if header in ("authorization", "x-api-key"):
                assert value == "<redacted>"


def test_sizes_are_real_and_bounded():
    sizes = {p.stem: p.stat().st_size for p in traffic.TRAFFIC.glob("*.json")}
    assert sum(sizes.values()) < 2_000_000
    assert sizes["claude_code_turn1"] > 40_000 and sizes["codex_turn1"] > 30_000  # tools kept whole


def test_chat_view_of_every_generation_request():
    for name, doc in all_docs().items():
        if doc["method"] != "POST":
            continue
        messages, tools = traffic.chat_view(doc)
        assert messages and all(isinstance(m["content"], str) for m in messages), name
        assert all(t["type"] == "function" and t["function"]["name"] for t in tools), name
    messages, tools = traffic.chat_view(traffic.load("codex_tool_output"))
    assert {"exec_command", "spawn_agent"} <= {t["function"]["name"] for t in tools}  # namespace flattened
    assert messages[-2]["tool_calls"][0]["function"]["name"] == "exec_command"
    assert messages[-1]["role"] == "tool"


@pytest.fixture(scope="module")
def realistic(build):
    from mlx_lm.utils import load_tokenizer

    path = build("qwen3_moe", tool_template=True, tokenizer_kind="bpe32k",
                 max_position_embeddings=131072)
    return load_tokenizer(path)


def test_claude_codes_first_request_is_its_real_size_in_tokens(realistic, build):
    from mlx_lm.utils import load_tokenizer

    doc = traffic.load("claude_code_turn1")
    n = traffic.prompt_tokens(doc, realistic)
    assert 8_000 < n < 30_000  # ~4 characters a token, as real tokenizers give
    tiny = traffic.prompt_tokens(doc, load_tokenizer(build("qwen3_moe", tool_template=True)))
    assert n * 2 < tiny


def test_the_readme_inventory_is_current():
    from tools.recorder.inventory import inventory

    readme = (traffic.TRAFFIC / "README.md").read_text()
    assert inventory(traffic.TRAFFIC) in readme
