"""Running each client against the recorder, for two turns in a scratch HOME; the extra
Claude Code runs (EXTRA_RUNS, picked by --runs) each in a scratch HOME of its own."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conformance.agent_clis import BIN, CACHE, base_env, claude_quiet, codex_flags, run

from .replies import (CLAUDE_MODEL, FINAL_TEXT, MODEL, PROMPT_LATER, PROMPT_SESSION2, PROMPT_TOOL,
                      PROMPT_WEATHER)
from .server import Recorder

AGENTS_VENV = CACHE / "agents-venv"


# -- running the clients ------------------------------------------------------------------


def agents_venv() -> Path:
    python = AGENTS_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(AGENTS_VENV)], check=True, timeout=300)
    probe = subprocess.run([str(python), "-c", "import agents"], capture_output=True)
    if probe.returncode:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "openai-agents"], check=True,
                       timeout=900)
    return python


def pip_version(python: Path | str, dist: str) -> str | None:
    r = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                       capture_output=True, text=True)
    return r.stdout.strip() or None


def claude_env(rec: Recorder, scratch: dict) -> dict:
    return base_env(scratch["home"]) | claude_quiet(scratch["home"]) | {
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{rec.port}",
        "ANTHROPIC_API_KEY": "sk-ant-recorder-dummy",
    }


def record_claude(rec: Recorder, scratch: dict) -> list[dict]:
    claude = BIN / "claude"
    env = claude_env(rec, scratch)
    results = []
    for label, args in (("claude_code.turn1", ["-p", PROMPT_TOOL, "--model", MODEL]),
                        ("claude_code.turn2", ["-p", PROMPT_LATER, "--continue", "--model", MODEL])):
        rec.label = label
        results.append({"label": label, **run([str(claude), *args, "--dangerously-skip-permissions"],
                                              env=env, cwd=scratch["project"])})
    # As most users run it: one of Claude's own model names (the request differs: a
    # fixed thinking budget, longer tool descriptions) and the nonessential traffic
    # left on (it probes the server with HEAD /api/hello). A fresh project directory,
    # so it does not continue the session above.
    rec.label = "claude_code.sonnet"
    project = scratch["home"] / "project2"
    shutil.copytree(scratch["project"], project)
    env = {k: v for k, v in env.items() if k != "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"}
    results.append({"label": rec.label, **run(
        [str(claude), "-p", PROMPT_TOOL, "--model", CLAUDE_MODEL, "--dangerously-skip-permissions"],
        env=env, cwd=project)})
    return results


def record_claude_session2(rec: Recorder, scratch: dict) -> list[dict]:
    """A second, separate `claude -p` session (its own scratch HOME) with another task:
    the billing line's per-session hash (`cc_version=<version>.<3 hex>`) may differ."""
    rec.label = "claude_code.session2"
    return [{"label": rec.label, **run(
        [str(BIN / "claude"), "-p", PROMPT_SESSION2, "--model", MODEL, "--dangerously-skip-permissions"],
        env=claude_env(rec, scratch), cwd=scratch["project"])}]


def record_claude_interactive(rec: Recorder, scratch: dict, first_party: bool = False,
                              timeout: float = 60) -> list[dict]:
    """One turn of an interactive session (no -p), typed into Claude Code in a private
    tmux server (the first-run dialogs: theme, the API key, trusting the folder, bypassing
    permissions, answered in its config). Its billing line says `cc_entrypoint=cli`. The
    per-request nonce (`cch=<5 hex>;`) and the prompt/turn fields come only with a base URL
    Claude Code takes for Anthropic's own (api.anthropic.com, -p or not): `first_party` makes
    it take the recorder's so (its internal `_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL=1`)."""
    label = rec.label = "claude_code.first_party" if first_party else "claude_code.interactive"
    tmux = shutil.which("tmux")
    if not tmux:
        return [{"label": label, "rc": None, "error": "tmux not found"}]
    key = "sk-ant-recorder-dummy"
    env = claude_env(rec, scratch) | {"TERM": "xterm-256color"}
    if first_party:
        env["_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL"] = "1"
    env.pop("NO_COLOR")
    config = Path(env["CLAUDE_CONFIG_DIR"])
    config.mkdir(parents=True, exist_ok=True)
    (config / ".claude.json").write_text(json.dumps({
        "hasCompletedOnboarding": True, "theme": "dark", "numStartups": 1,
        "customApiKeyResponses": {"approved": [key[-20:]], "rejected": []},
        "projects": {str(scratch["project"]): {"hasTrustDialogAccepted": True,
                                                "hasCompletedProjectOnboarding": True}}}))
    (config / "settings.json").write_text(json.dumps({"skipDangerousModePermissionPrompt": True}))
    cmd = [str(BIN / "claude"), "--model", MODEL, "--dangerously-skip-permissions"]
    socket_name = f"record-agents-{os.getpid()}"
    t = [tmux, "-L", socket_name, "-f", "/dev/null"]
    start = time.monotonic()

    def screen() -> str:
        return subprocess.run([*t, "capture-pane", "-p", "-t", "rec"], capture_output=True, text=True).stdout

    def main_requests() -> list[dict]:
        return [s for s in rec.summary if s["label"] == label and s["method"] == "POST"
                and s["path"].split("?")[0].endswith("/messages")]

    def wait(until) -> bool:
        while time.monotonic() - start < timeout:
            if until():
                return True
            time.sleep(0.5)
        return False

    subprocess.run([*t, "new-session", "-d", "-s", "rec", "-x", "160", "-y", "50", "-c", str(scratch["project"]),
                    # the pane stays after an exit, to be read
                    shlex.join(["env", "-i", *(f"{k}={v}" for k, v in env.items()), *cmd]) + "; sleep 600"],
                   check=True)
    try:
        ready = wait(lambda: "bypass permissions on" in screen())
        subprocess.run([*t, "send-keys", "-t", "rec", "-l", PROMPT_TOOL], check=True)
        time.sleep(0.5)
        subprocess.run([*t, "send-keys", "-t", "rec", "Enter"], check=True)
        # the turn: its request, the tool call, the request with the result, the answer
        done = wait(lambda: FINAL_TEXT in screen())
        time.sleep(1)
        last = screen()
        subprocess.run([*t, "send-keys", "-t", "rec", "-l", "/exit"])
        subprocess.run([*t, "send-keys", "-t", "rec", "Enter"])
        time.sleep(2)
    finally:
        subprocess.run([*t, "kill-server"], capture_output=True)
    return [{"label": label, "cmd": [*(["_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL=1"] if first_party else []),
                                     *cmd, f"(in tmux, typed: {PROMPT_TOOL!r}, then /exit)"],
             "rc": 0 if done else 1, "timed_out": not done, "ready": ready,
             "seconds": round(time.monotonic() - start, 1), "requests": len(main_requests()),
             "stdout": last[-4000:], "stderr": ""}]


# The runs that --runs can pick, each in a fresh scratch HOME: their files are added to
# the recording in --out (index.json and README.md updated) and nothing else is rewritten.
EXTRA_RUNS = {"claude_code.session2": record_claude_session2,
              "claude_code.interactive": record_claude_interactive,
              "claude_code.first_party": lambda rec, scratch: record_claude_interactive(rec, scratch, True)}


CODEX_CONFIG = """\
model = "{model}"
model_provider = "mlxs"
check_for_update_on_startup = false

[model_providers.mlxs]
name = "mlx-streaming recorder"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "MLXS_API_KEY"

[analytics]
enabled = false

[feedback]
enabled = false
"""


def record_codex(rec: Recorder, scratch: dict, sandbox: str) -> list[dict]:
    codex = BIN / "codex"
    codex_home = scratch["home"] / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(model=MODEL, port=rec.port))
    env = base_env(scratch["home"]) | {"CODEX_HOME": str(codex_home), "MLXS_API_KEY": "recorder-dummy"}
    flags, resume_flags = codex_flags(sandbox)
    results = []
    for label, args in (("codex.turn1", ["exec", *flags, PROMPT_TOOL]),
                        ("codex.turn2", ["exec", "resume", "--last", *resume_flags, PROMPT_LATER])):
        rec.label = label
        results.append({"label": label, **run([str(codex), *args], env=env, cwd=scratch["project"])})
    return results


AGENTS_SCRIPT = textwrap.dedent("""\
    import asyncio, sys
    from openai import AsyncOpenAI
    from agents import Agent, Runner, function_tool, set_tracing_disabled, OpenAIResponsesModel

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        '''The current weather in a city.'''
        return f"It is sunny in {city}."

    async def main(base_url, mode):
        client = AsyncOpenAI(base_url=base_url, api_key="sk-recorder-dummy")
        agent = Agent(name="Assistant", instructions="You are a helpful assistant. Use tools when useful.",
                      tools=[get_weather], model=OpenAIResponsesModel(model=sys.argv[3], openai_client=client))
        if mode == "streamed":
            result = Runner.run_streamed(agent, sys.argv[4])
            async for _ in result.stream_events():
                pass
        elif mode == "chained":  # the server keeps the history: previous_response_id
            result = await Runner.run(agent, sys.argv[4], auto_previous_response_id=True)
        else:
            result = await Runner.run(agent, sys.argv[4])
        print(result.final_output)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """)


def record_agents(rec: Recorder, scratch: dict, python: Path) -> list[dict]:
    env = base_env(scratch["home"]) | {"OPENAI_AGENTS_DISABLE_TRACING": "1",
                                       "OPENAI_API_KEY": "sk-recorder-dummy"}
    results = []
    for mode in ("run", "streamed", "chained"):
        rec.label = f"openai_agents.{mode}"
        results.append({"label": rec.label, **run(
            [str(python), "-c", AGENTS_SCRIPT, f"http://127.0.0.1:{rec.port}/v1", mode, MODEL,
             PROMPT_WEATHER], env=env, cwd=scratch["project"], timeout=120)})
    return results


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"], "additionalProperties": False}


def record_sdks(rec: Recorder) -> list[dict]:
    """The official openai and anthropic Python clients, in this process: each API once
    whole with a tool round trip and once streamed (the first turn)."""
    import anthropic
    import openai

    results = []
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{rec.port}/v1", api_key="sk-recorder-dummy",
                       max_retries=0)
    an = anthropic.Anthropic(base_url=f"http://127.0.0.1:{rec.port}", api_key="sk-ant-recorder-dummy",
                             max_retries=0)
    chat_tool = {"type": "function", "function": {"name": "get_weather",
                                                   "description": "The current weather in a city.",
                                                   "parameters": WEATHER_PARAMS}}
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": PROMPT_WEATHER}]

    def step(label, fn):
        rec.label = label
        start = time.monotonic()
        try:
            fn()
            results.append({"label": label, "rc": 0, "seconds": round(time.monotonic() - start, 2)})
        except Exception as exc:  # noqa: BLE001 (reported, the other steps still run)
            results.append({"label": label, "rc": 1, "error": repr(exc)[:500]})

    def chat_whole():
        first = oa.chat.completions.create(model=MODEL, messages=messages, tools=[chat_tool])
        call = first.choices[0].message.tool_calls[0]
        oa.chat.completions.create(model=MODEL, tools=[chat_tool], messages=[
            *messages, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "It is sunny in Paris."}])

    def chat_streamed():
        for _ in oa.chat.completions.create(model=MODEL, messages=messages, tools=[chat_tool],
                                            stream=True, stream_options={"include_usage": True}):
            pass

    resp_tool = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
                 "parameters": WEATHER_PARAMS, "strict": True}

    def responses_whole():
        first = oa.responses.create(model=MODEL, instructions="You are a helpful assistant.",
                                    input=PROMPT_WEATHER, tools=[resp_tool])
        call = next(o for o in first.output if o.type == "function_call")
        oa.responses.create(model=MODEL, instructions="You are a helpful assistant.", tools=[resp_tool],
                            previous_response_id=first.id,
                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": "It is sunny in Paris."}])

    def responses_streamed():
        with oa.responses.stream(model=MODEL, input=PROMPT_WEATHER, tools=[resp_tool]) as stream:
            for _ in stream:
                pass
            stream.get_final_response()

    an_tool = {"name": "get_weather", "description": "The current weather in a city.",
               "input_schema": WEATHER_PARAMS}

    def anthropic_whole():
        ask = [{"role": "user", "content": PROMPT_WEATHER}]
        first = an.messages.create(model=MODEL, max_tokens=256, system="You are a helpful assistant.",
                                   messages=ask, tools=[an_tool])
        use = next(b for b in first.content if b.type == "tool_use")
        an.messages.create(model=MODEL, max_tokens=256, system="You are a helpful assistant.",
                           tools=[an_tool], messages=[
                               *ask, {"role": "assistant", "content": first.content},
                               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                             "content": "It is sunny in Paris."}]}])

    def anthropic_streamed():
        with an.messages.stream(model=MODEL, max_tokens=256, tools=[an_tool],
                                messages=[{"role": "user", "content": PROMPT_WEATHER}]) as stream:
            stream.get_final_message()

    step("openai_sdk.chat", chat_whole)
    step("openai_sdk.chat_stream", chat_streamed)
    step("openai_sdk.responses", responses_whole)
    step("openai_sdk.responses_stream", responses_streamed)
    step("anthropic_sdk.messages", anthropic_whole)
    step("anthropic_sdk.messages_stream", anthropic_streamed)
    return results
