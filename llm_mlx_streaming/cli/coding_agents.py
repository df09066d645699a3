"""What each coding agent needs to work on this server: its command, the npm package
that installs it, and the environment that points it here (docs/server.md, "Coding
agents")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import llm

from .background import Served

CODEX_HOME = "codex-home"  # under llm.user_dir()/mlx-streaming
CODEX_KEY_VAR = "MLX_STREAM_API_KEY"
CODEX_PROVIDER = "mlx-stream"

# Claude Code picks a model per task from these (the main loop, its tiers, subagents):
# all name the served model, so no request asks for a model the server does not serve.
CLAUDE_MODEL_VARS = ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                     "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")
CLAUDE_SMALL_VARS = ("ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")  # `launch --small-model`


def claude_env(env: dict, served: Served, context: int) -> dict:
    """The key goes as a bearer token (ANTHROPIC_AUTH_TOKEN): ANTHROPIC_API_KEY would be
    asked about in every new interactive session (the key changes with each server), and
    one the user has set would be sent here, so it is left out. The context window is
    the server's, so Claude Code compacts the conversation before the server would refuse
    it (for a model id it does not know it assumes a far larger one). Its billing line,
    which differs from one session to the next in front of the whole prompt, is turned
    off (the server also leaves it out of the prompt: server/anthropic)."""
    out = {k: v for k, v in env.items() if k != "ANTHROPIC_API_KEY"}
    out.update({"ANTHROPIC_BASE_URL": served.url, "ANTHROPIC_AUTH_TOKEN": served.key,
                "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(context), "CLAUDE_CODE_ATTRIBUTION_HEADER": "0"})
    out.update({name: served.model_id for name in CLAUDE_MODEL_VARS})
    if served.small_model_id:  # the fast tier and subagents on a second model, loaded beside the first
        out.update({name: served.small_model_id for name in CLAUDE_SMALL_VARS})
    return out


CODEX_CONFIG = """\
# Written by `llm mlxs launch codex` at every launch: Codex on `llm mlxs serve`.
model = {model}
model_provider = "{provider}"
model_context_window = {context}

[model_providers.{provider}]
name = "llm mlxs serve"
base_url = {base_url}
wire_api = "responses"
env_key = "{key_var}"
"""


def codex_home() -> Path:
    return llm.user_dir() / "mlx-streaming" / CODEX_HOME


def codex_env(env: dict, served: Served, context: int) -> dict:
    """A CODEX_HOME of ours whose config.toml names the server as the model provider
    (the Responses API) and its context window; the user's own ~/.codex is neither read
    nor changed. Codex keeps its sessions there too, so `launch codex -- resume --last`
    continues across launches."""
    home = codex_home()
    home.mkdir(parents=True, exist_ok=True)
    # JSON strings are TOML basic strings
    (home / "config.toml").write_text(CODEX_CONFIG.format(
        model=json.dumps(served.model_id), provider=CODEX_PROVIDER, context=context,
        base_url=json.dumps(f"{served.url}/v1"), key_var=CODEX_KEY_VAR))
    return {**env, "CODEX_HOME": str(home), CODEX_KEY_VAR: served.key}


@dataclass(frozen=True)
class Agent:
    command: str
    package: str  # on npm
    environment: Callable[[dict, Served, int], dict]  # (env, server, its context in tokens) -> the agent's env


AGENTS = {
    "claude": Agent("claude", "@anthropic-ai/claude-code", claude_env),
    "codex": Agent("codex", "@openai/codex", codex_env),
}
