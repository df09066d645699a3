"""The client matrix: real clients, installed from their registries, each for two turns
(the second continuing the first) against a served model that ends its turns. Not run
in CI.

    python conformance/clients.py [--no-install] [--only NAME,...] [--timeout 180]

What it does:

1. Installs the clients, the newest of each: the Python libraries and CLIs into one venv,
   conformance/.cache/clients-venv; aider into its own, conformance/.cache/aider-venv (it
   pins exact versions of all its dependencies, litellm and openai among them, older than
   the other clients need; its own installer gives it a separate environment too); the
   node ones into conformance/.cache/npm beside Claude Code and Codex
   (conformance/agent_clis.py).
2. Builds the tool-template checkpoint with the realistic tokenizer and serves it in this
   process on 127.0.0.1, every reply forced to "Done." and the end of the turn
   (agent_clis.ScriptedServer), from a scratch llm user dir.
3. Runs each client for two turns in a scratch HOME of its own, each turn one process
   under a timeout in its own process group: a CLI with its own way of continuing a
   session (`llm -c`, `--continue`, `resume --last`, aider's restored history), a library
   through a driver that keeps the conversation in a file (conformance/client_drivers.py,
   conformance/ai_sdk_turn.mjs). Every client is pointed at the server's URL, with its
   telemetry and update checks switched off where it has a switch.
4. Prints one row per client and turn (client, version, API, turn, exit status, ok or
   the error in one line; and what the server saw: its generations, the largest prompt,
   the tokens reused from the KV cache), then the table for docs/server.md ("Clients").
   A turn is ok when it exits 0 within the timeout, prints the reply, "Done.", and made
   the server generate; the second also continued the first: its second prompt is the
   shorter, so only a conversation that holds turn 1 sends a larger prompt than turn 1's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # agent_clis, beside it
from agent_clis import (BIN, CACHE, MODEL, NPM, PROMPTS, ROOT, SCRIPTED_REPLY, ScriptedServer,  # noqa: E402
                        add_model, base_env, build_checkpoint, launch_env, launch_turns,
                        make_scratch, npm_install, npm_version, run)

sys.path.insert(0, str(ROOT))
VENV = CACHE / "clients-venv"
AIDER_VENV = CACHE / "aider-venv"
PYPI = ("litellm", "llm", "llm-ollama", "openai-agents", "langchain-openai", "langchain-ollama",
        "pydantic-ai-slim[openai]", "ollama", "openai", "anthropic")
NPM_PACKAGES = ("opencode-ai", "ai", "@ai-sdk/openai-compatible", "@continuedev/cli", "@qwen-code/qwen-code",
                "@mariozechner/pi-coding-agent")
DRIVERS = Path(__file__).resolve().parent / "client_drivers.py"
AI_SDK_TURN = Path(__file__).resolve().parent / "ai_sdk_turn.mjs"
SERVED = f"mlx-stream/{MODEL}"  # the served model's id, as the clients name it
MAX_TOKENS = 32
PIP_TIMEOUT = 1800


@dataclass
class Setup:
    """What a client's turns are built from: the server, and the client's scratch dirs."""

    url: str
    home: Path
    project: Path
    max_tokens: int


@dataclass(frozen=True)
class Client:
    name: str
    package: str  # whose version the row shows
    where: Path  # where it is installed: a venv, or NPM
    api: str
    turns: Callable[[Setup], list[tuple[list[str], dict]]]  # each turn's command and environment


def python_env(setup: Setup) -> dict:
    # litellm fetches its model price list from the web at import unless told to use its own copy
    return base_env(setup.home) | {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def driven(driver: str):
    """A Python library's turns, through client_drivers.py in the clients' venv."""
    def turns(setup: Setup):
        state = setup.home / "conversation.json"
        return [([str(VENV / "bin" / "python"), "-P", str(DRIVERS), driver, setup.url, str(state), prompt],
                 python_env(setup)) for prompt in PROMPTS]
    return turns


def llm_cli(model: str, extra_openai: bool):
    """`llm -m MODEL PROMPT`, then `llm -c PROMPT`, in a user dir of the client's own."""
    def turns(setup: Setup):
        user_dir = setup.home / "llm"
        user_dir.mkdir()
        if extra_openai:
            (user_dir / "extra-openai-models.yaml").write_text(
                f"- model_id: mlxs\n  model_name: {SERVED}\n  api_base: {setup.url}/v1\n")
        # OLLAMA_HOST for both: llm-ollama, in the same venv, lists the models it finds there
        env = python_env(setup) | {"LLM_USER_PATH": str(user_dir), "OLLAMA_HOST": setup.url}
        llm = str(VENV / "bin" / "llm")
        return [([llm, "-m", model, PROMPTS[0]], env), ([llm, "-c", PROMPTS[1]], env)]
    return turns


def launched(client: str):
    """Claude Code or Codex through `llm mlxs launch`, which finds the running server."""
    def turns(setup: Setup):
        env = launch_env(client, setup.home, setup.max_tokens)
        return [([sys.executable, "-m", "llm", "mlxs", "launch", client, MODEL, "--", *args], env)
                for args in launch_turns(client, "workspace-write")]
    return turns


def node_env(setup: Setup) -> dict:
    return base_env(setup.home) | {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def ai_sdk(setup: Setup):
    script = NPM / AI_SDK_TURN.name  # beside node_modules, where its imports resolve
    shutil.copyfile(AI_SDK_TURN, script)
    state = setup.home / "conversation.json"
    return [(["node", str(script), setup.url, str(state), prompt], node_env(setup)) for prompt in PROMPTS]


def opencode(setup: Setup):
    config = setup.home / ".config" / "opencode"
    config.mkdir(parents=True)
    (config / "opencode.json").write_text(json.dumps({
        "autoupdate": False, "share": "disabled", "model": f"mlxs/{SERVED}",
        "provider": {"mlxs": {"npm": "@ai-sdk/openai-compatible", "name": "llm mlxs serve",
                              "options": {"baseURL": f"{setup.url}/v1", "apiKey": "sk-unused"},
                              "models": {SERVED: {"name": MODEL}}}}}))
    env = node_env(setup) | {flag: "1" for flag in (
        "OPENCODE_DISABLE_AUTOUPDATE", "OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_SHARE",
        "OPENCODE_DISABLE_LSP_DOWNLOAD", "OPENCODE_DISABLE_DEFAULT_PLUGINS", "OPENCODE_DISABLE_CLAUDE_CODE")}
    cli = str(BIN / "opencode")
    return [([cli, "run", PROMPTS[0]], env), ([cli, "run", "--continue", PROMPTS[1]], env)]


def continue_cli(setup: Setup):
    config = setup.home / "continue.yaml"
    config.write_text(f"name: llm mlxs serve\nversion: 1.0.0\nschema: v1\nmodels:\n  - name: {MODEL}\n"
                      f"    provider: openai\n    model: {SERVED}\n    apiBase: {setup.url}/v1\n"
                      "    apiKey: sk-unused\n    roles: [chat, edit, apply]\n")
    env = node_env(setup) | {"CONTINUE_CLI_ENABLE_TELEMETRY": "0"}
    cli = [str(BIN / "cn"), "-p", "--config", str(config)]
    return [([*cli, PROMPTS[0]], env), ([*cli, "--resume", PROMPTS[1]], env)]


def qwen_code(setup: Setup):
    (setup.home / ".qwen").mkdir()
    (setup.home / ".qwen" / "settings.json").write_text(json.dumps({
        "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}))
    env = node_env(setup) | {"OPENAI_BASE_URL": f"{setup.url}/v1", "OPENAI_API_KEY": "sk-unused",
                             "OPENAI_MODEL": SERVED}
    cli = [str(BIN / "qwen"), "--auth-type", "openai"]
    return [([*cli, PROMPTS[0]], env), ([*cli, "--continue", PROMPTS[1]], env)]


def pi(setup: Setup):
    agent = setup.home / ".pi" / "agent"
    agent.mkdir(parents=True)
    (agent / "models.json").write_text(json.dumps({"providers": {"mlxs": {
        "baseUrl": f"{setup.url}/v1", "api": "openai-completions", "apiKey": "sk-unused",
        "models": [{"id": SERVED, "name": MODEL, "contextWindow": 32768, "maxTokens": setup.max_tokens}]}}}))
    env = node_env(setup) | {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0"}
    cli = [str(BIN / "pi"), "-p", "--provider", "mlxs", "--model", SERVED]
    return [([*cli, PROMPTS[0]], env), ([*cli, "--continue", PROMPTS[1]], env)]


def aider(setup: Setup):
    env = python_env(setup) | {"OPENAI_API_BASE": f"{setup.url}/v1", "OPENAI_API_KEY": "sk-unused"}
    cli = [str(AIDER_VENV / "bin" / "aider"), "--model", f"openai/{SERVED}", "--no-git", "--yes-always",
           "--no-check-update", "--analytics-disable", "--no-show-model-warnings", "--no-pretty",
           "--no-fancy-input", "--map-tokens", "0"]
    return [([*cli, "--message", PROMPTS[0]], env), ([*cli, "--restore-chat-history", "--message", PROMPTS[1]], env)]


CLIENTS = [
    *(Client(f"litellm `{provider}/`{', streamed' if stream else ''}", "litellm", VENV,
             api + (", streamed" if stream else ""), driven(f"litellm-{provider}{'-stream' if stream else ''}"))
      for provider, api in (("openai", "OpenAI chat"), ("anthropic", "Anthropic"), ("ollama_chat", "Ollama chat"),
                            ("ollama", "Ollama generate"))
      for stream in (False, True)),
    Client("`llm` (extra-openai-models.yaml)", "llm", VENV, "OpenAI chat, streamed", llm_cli("mlxs", True)),
    Client("`llm-ollama`", "llm-ollama", VENV, "Ollama chat, streamed", llm_cli(f"ollama/{SERVED}", False)),
    Client("openai-agents, Responses model", "openai-agents", VENV, "Responses", driven("openai-agents-responses")),
    Client("openai-agents, chat model", "openai-agents", VENV, "OpenAI chat", driven("openai-agents-chat")),
    Client("openai", "openai", VENV, "OpenAI chat", driven("openai")),
    Client("anthropic", "anthropic", VENV, "Anthropic", driven("anthropic")),
    Client("ollama", "ollama", VENV, "Ollama chat", driven("ollama")),
    Client("langchain-openai", "langchain-openai", VENV, "OpenAI chat", driven("langchain-openai")),
    Client("langchain-ollama", "langchain-ollama", VENV, "Ollama chat", driven("langchain-ollama")),
    Client("pydantic-ai", "pydantic-ai-slim", VENV, "OpenAI chat", driven("pydantic-ai")),
    Client("aider", "aider-chat", AIDER_VENV, "OpenAI chat, streamed", aider),
    Client("Claude Code (`llm mlxs launch claude`)", "@anthropic-ai/claude-code", NPM, "Anthropic, streamed",
           launched("claude")),
    Client("Codex (`llm mlxs launch codex`)", "@openai/codex", NPM, "Responses, streamed", launched("codex")),
    Client("opencode", "opencode-ai", NPM, "OpenAI chat, streamed", opencode),
    Client("Vercel AI SDK (`ai`, openai-compatible)", "ai", NPM, "OpenAI chat, streamed", ai_sdk),
    Client("Continue CLI (`cn`)", "@continuedev/cli", NPM, "OpenAI chat, streamed", continue_cli),
    Client("Qwen Code", "@qwen-code/qwen-code", NPM, "OpenAI chat, streamed", qwen_code),
    Client("pi", "@mariozechner/pi-coding-agent", NPM, "OpenAI chat, streamed", pi),
]


def pip_install(venv: Path, packages: tuple[str, ...]) -> None:
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--upgrade", "--disable-pip-version-check",
           *packages]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=PIP_TIMEOUT)


def install(claude: str, codex: str) -> None:
    pip_install(VENV, PYPI)
    pip_install(AIDER_VENV, ("aider-chat",))
    npm_install(claude, codex, *(f"{package}@latest" for package in NPM_PACKAGES))


def versions(clients: list[Client]) -> dict[Client, str | None]:
    """Each client's package version, as installed."""
    out = {}
    for venv in (VENV, AIDER_VENV):
        mine = [c for c in clients if c.where == venv]
        if not mine:
            continue
        probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import importlib.metadata as m, json, sys\n"
                                "print(json.dumps([m.version(d) for d in sys.argv[1:]]))",
                                *(c.package for c in mine)], capture_output=True, text=True, timeout=60)
        out |= dict(zip(mine, json.loads(probe.stdout) if probe.returncode == 0 else []))
    return out | {c: npm_version(c.package) for c in clients if c.where == NPM}


def verdict(result: dict, timeout: int, made: list[dict], before: list[dict]) -> str:
    """"ok", or what went wrong in one line. `made`: the generations the server finished
    during this turn; `before`: those of the client's earlier turn (none on the first)."""
    if result["timed_out"]:
        return f"timed out after {timeout} s"
    lines = [line.strip() for line in (result["stderr"] or result["stdout"]).splitlines() if line.strip()]
    if result["rc"] != 0:
        return (lines[-1] if lines else "(no output)")[:300]
    if SCRIPTED_REPLY not in result["stdout"]:
        out = [line.strip() for line in result["stdout"].splitlines() if line.strip()]
        return f"exit 0 without the reply: {(out[-1] if out else '(no output)')[:240]}"
    if not made:
        return "exit 0 without a generation on the server"
    if before and largest(made) <= largest(before):
        # the second prompt is shorter than the first: only a conversation that holds the
        # first turn makes a larger prompt
        return f"did not continue turn 1: its largest prompt {largest(made)} tokens, turn 1's {largest(before)}"
    return "ok"


def largest(generations: list[dict]) -> int:
    return max(g["prompt_tokens"] or 0 for g in generations)


def run_client(client: Client, url: str, args) -> list[dict]:
    from llm_mlx_streaming.activity import ACTIVITY  # the in-process server's record

    scratch = make_scratch("clients-")
    try:
        setup = Setup(url, scratch["home"], scratch["project"], MAX_TOKENS)
        rows, before = [], []
        for turn, (cmd, env) in enumerate(client.turns(setup), 1):
            seen = max((g["n"] for g in ACTIVITY.recent_responses()), default=0)
            result = run(cmd, env=env, cwd=setup.project, timeout=args.timeout)
            made = ACTIVITY.recent_responses(seen)
            rows.append({"client": client, "turn": turn, "rc": "-" if result["timed_out"] else result["rc"],
                         "seconds": result["seconds"], "generations": len(made),
                         "prompt": largest(made) if made else None,
                         "reused": max((g["reused_tokens"] or 0 for g in made), default=None),
                         "result": verdict(result, args.timeout, made, before)})
            before = made
            print(f"{client.name} turn {turn}: exit {rows[-1]['rc']}, {result['seconds']} s: {rows[-1]['result']}",
                  flush=True)
        return rows
    finally:
        shutil.rmtree(scratch["work"], ignore_errors=True)


def report(rows: list[dict], vers: dict[Client, str | None], command: str, install_s: float, run_s: float) -> None:
    print("\n| client | version | API | turn | exit | s | generations | largest prompt | reused | result |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        c = row["client"]
        print(f"| {c.name} | {vers.get(c) or '-'} | {c.api} | {row['turn']} | {row['rc']} | {row['seconds']} | "
              f"{row['generations']} | {_n(row['prompt'])} | {_n(row['reused'])} | {_cell(row['result'])} |")
    print(f"\nFor docs/server.md: `{command}` on {datetime.date.today()}; installing {install_s:.0f} s, "
          f"the checkpoint, the server and {len(rows)} turns {run_s:.0f} s\n")
    print("| client | version | API | turns | result |\n| --- | --- | --- | --- | --- |")
    for client in dict.fromkeys(row["client"] for row in rows):
        mine = [row for row in rows if row["client"] == client]
        failures: dict[str, list[str]] = {}  # each error, and the turns that had it
        for row in mine:
            if row["result"] != "ok":
                failures.setdefault(row["result"], []).append(str(row["turn"]))
        result = "; ".join(f"turn{'s' if len(turns) > 1 else ''} {', '.join(turns)}: {error}"
                           for error, turns in failures.items())
        print(f"| {client.name} | {vers.get(client) or '-'} | {client.api} | {len(mine)} | {_cell(result or 'ok')} |")


def _n(value) -> str:
    return "-" if value is None else f"{value:,}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-install", action="store_true", help="use what conformance/.cache holds")
    ap.add_argument("--only", default="", help="comma-separated words; run the clients whose name has one")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per turn")
    ap.add_argument("--claude-version", default="latest")
    ap.add_argument("--codex-version", default="latest")
    args = ap.parse_args()

    start = time.monotonic()
    if not args.no_install:
        install(args.claude_version, args.codex_version)
    installed = time.monotonic()
    clients = [c for c in CLIENTS if not args.only or any(w.lower() in c.name.lower() for w in args.only.split(","))]
    checkpoint = build_checkpoint()
    from llm_mlx_streaming.cli.background import model_id

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    server_dir = make_scratch("clients-server-")
    os.environ["LLM_USER_PATH"] = str(server_dir["work"] / "llm")
    try:
        add_model(checkpoint, MAX_TOKENS)
        server = ScriptedServer(model_id(MODEL))
        try:
            print(f"serving {SERVED} at {server.url}", flush=True)
            rows = [row for client in clients for row in run_client(client, server.url, args)]
        finally:
            server.close()
    finally:
        shutil.rmtree(server_dir["work"], ignore_errors=True)
    command = "python conformance/clients.py" + "".join(f" {a}" for a in sys.argv[1:])
    report(rows, versions(clients), command, installed - start, time.monotonic() - installed)
    return 0 if all(row["result"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
