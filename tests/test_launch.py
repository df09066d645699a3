"""`llm mlxs launch claude|codex`: a fake `claude` / `codex` on PATH records what it was
given, makes one real request to the server it was pointed at, and exits with a chosen
status."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from plugin_support import assert_one_line_error, serving

FAKE_AGENT = """\
#!{python}
import json, os, sys, tomllib, urllib.request

env = dict(os.environ)
record = {{"name": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "env": env}}
if record["name"] == "claude":
    url = env["ANTHROPIC_BASE_URL"] + "/v1/messages"
    body = {{"model": env["ANTHROPIC_MODEL"], "max_tokens": 2, "messages": [{{"role": "user", "content": "hi"}}]}}
    key = env["ANTHROPIC_AUTH_TOKEN"]
else:
    with open(os.path.join(env["CODEX_HOME"], "config.toml"), "rb") as f:
        record["config"] = config = tomllib.load(f)
    provider = config["model_providers"][config["model_provider"]]
    url = provider["base_url"] + "/responses"
    body = {{"model": config["model"], "input": "hi", "max_output_tokens": 2}}
    key = env[provider["env_key"]]
record["server"] = json.load(open(os.path.join(env["LLM_USER_PATH"], "mlx-streaming", "server.json")))
request = urllib.request.Request(url, json.dumps(body).encode(),
                                 {{"Authorization": "Bearer " + key, "Content-Type": "application/json"}})
with urllib.request.urlopen(request, timeout=60) as resp:
    record["reply"] = json.loads(resp.read())
with open(env["FAKE_AGENT_RECORD"], "w") as f:
    json.dump(record, f)
sys.exit(int(env.get("FAKE_AGENT_EXIT", "0")))
"""


@pytest.fixture
def agents(llm_env, tmp_path, monkeypatch):
    """Fake agents first on PATH; a HOME with the user's own ~/.codex; max_context 8192;
    the record path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("claude", "codex"):
        (bin_dir / name).write_text(FAKE_AGENT.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text('model = "the-users-own"\n')
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("ANTHROPIC_API_KEY", "the-users-real-key")
    monkeypatch.setenv("FAKE_AGENT_RECORD", str(tmp_path / "record.json"))
    llm_env.write_settings(**llm_env.read_settings(), max_context=8192)
    llm_env.record = tmp_path / "record.json"
    llm_env.home = home
    return llm_env


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_claude_gets_the_server_its_key_and_model_everywhere_and_the_started_server_stops(agents, monkeypatch):
    from llm_mlx_streaming import discovery

    monkeypatch.setenv("FAKE_AGENT_EXIT", "3")
    result = agents.run("mlxs", "launch", "claude", "--", "-p", "hello", "--continue")
    assert result.exit_code == 3, result.output  # the agent's own status
    record = json.loads(agents.record.read_text())
    env, server = record["env"], record["server"]
    assert record["argv"] == ["-p", "hello", "--continue"]
    assert env["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{server['port']}"
    assert env["ANTHROPIC_AUTH_TOKEN"] == server["secret"] and "ANTHROPIC_API_KEY" not in env
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192"  # the server's max_context
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"  # no billing line in front of the prompt
    for name in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert env[name] == "mlx-stream/small", name
    assert record["reply"]["type"] == "message" and record["reply"]["model"] == "mlx-stream/small"
    # started for the agent, stopped after it
    assert server["pid"] != os.getpid() and _gone(server["pid"])
    assert discovery.read() is None
    said = result.stderr
    assert "starting a server for mlx-stream/small" in said and "mlx-stream/small loaded in" in said
    log = (agents.user_dir / "mlx-streaming" / "launch-serve.log").read_text()
    assert "server stopped" in log and "terminate called" not in log and "Traceback" not in log  # a clean stop


def test_codex_gets_a_codex_home_of_ours_and_the_users_own_is_untouched(agents):
    import tomllib

    from llm_mlx_streaming.cli.coding_agents import codex_home

    users_own = (agents.home / ".codex" / "config.toml").read_text()
    result = agents.run("mlxs", "launch", "codex", "small", "--", "exec", "--skip-git-repo-check", "hi")
    assert result.exit_code == 0, result.output
    record = json.loads(agents.record.read_text())
    env, server = record["env"], record["server"]
    assert record["argv"] == ["exec", "--skip-git-repo-check", "hi"]
    assert env["CODEX_HOME"] == str(codex_home()) and codex_home().parent == agents.user_dir / "mlx-streaming"
    config = tomllib.loads((codex_home() / "config.toml").read_text())
    assert config == record["config"]
    assert config["model"] == "mlx-stream/small" and config["model_provider"] == "mlx-stream"
    assert config["model_context_window"] == 8192  # the server's max_context
    provider = config["model_providers"]["mlx-stream"]
    assert provider["base_url"] == f"http://127.0.0.1:{server['port']}/v1"
    assert provider["wire_api"] == "responses" and env[provider["env_key"]] == server["secret"]
    assert record["reply"]["object"] == "response" and record["reply"]["model"] == "mlx-stream/small"
    assert (agents.home / ".codex" / "config.toml").read_text() == users_own
    assert list((agents.home / ".codex").iterdir()) == [agents.home / ".codex" / "config.toml"]
    assert _gone(server["pid"])


def test_a_running_server_is_used_and_left_running(agents):
    with serving(agents, api_key="the-servers-key") as env:
        url, secret = env.server.url, env.server.info.secret
        start = time.monotonic()
        result = env.run("mlxs", "launch", "claude", "--", "-p", "hi")
        assert result.exit_code == 0, result.output
        assert time.monotonic() - start < 30
        record = json.loads(agents.record.read_text())
        assert record["env"]["ANTHROPIC_BASE_URL"] == url and record["env"]["ANTHROPIC_AUTH_TOKEN"] == secret
        assert record["server"]["pid"] == os.getpid()
        assert "starting" not in result.stderr and "loading mlx-stream/small on the server at " + url in result.stderr
        # left running, and still answering
        from llm_mlx_streaming import discovery

        assert discovery.read() is not None and not env.server.uvicorn.should_exit
        # a launch for a model other than the one it has loaded is refused: it would swap it out
        assert_one_line_error(env.run("mlxs", "launch", "codex", "tiny-moe"), "serves mlx-stream/small")


def test_claude_small_model_maps_the_fast_tier_to_a_second_model_loaded_beside_the_first(agents):
    from llm_mlx_streaming.cli.background import model_id

    with serving(agents) as env:
        result = env.run("mlxs", "launch", "claude", "--small-model", "tiny-moe", "--", "-p", "hi")
        assert result.exit_code == 0, result.output
        env_ = json.loads(agents.record.read_text())["env"]
        small = model_id("tiny-moe")
        for name in ("ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
            assert env_[name] == small, name
        for name in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL"):
            assert env_[name] == "mlx-stream/small", name
        loaded = {ids for m in env.server.service.models_figures() for ids in m["ids"]}
        assert {"mlx-stream/small", small} <= loaded  # both stay loaded: no request swaps one out


@pytest.mark.parametrize("agent,package", [("claude", "@anthropic-ai/claude-code"), ("codex", "@openai/codex")])
def test_an_agent_not_installed_is_one_line_naming_how_to_install_it(llm_env, tmp_path, monkeypatch, agent, package):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert_one_line_error(llm_env.run("mlxs", "launch", agent), f"npm install -g {package}")
