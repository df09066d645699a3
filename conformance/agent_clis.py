"""Claude Code and Codex from the npm registry, run non-interactively in a scratch HOME,
and a served model that ends its turns: what tools/recorder/,
conformance/agents.py and conformance/clients.py share.

The CLIs go into conformance/.cache/npm (an explicit tag: with an old node, a bare name
makes npm pick an older release whose `engines` match; the CLIs ship native binaries,
so node's version does not matter to them). Each run is in its own process group under
a timeout, killed at the end, with the clients' telemetry, update checks and
nonessential traffic switched off.

The model is the tool-template checkpoint (qwen3_moe, Qwen's tool template, the
32k-token BPE tokenizer, 32,768 positions) built into conformance/.cache/agents-checkpoint;
ScriptedServer serves a checkpoint in this process with every reply forced (by default
to "Done." and the end of the turn: fixtures.scripted.Force), as a trained model would
end it: random weights never end a turn, and agents take that as an error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "conformance" / ".cache"
NPM = CACHE / "npm"
BIN = NPM / "node_modules" / ".bin"  # `claude`, `codex`
CLI_TIMEOUT = 240  # seconds per CLI invocation
PACKAGES = {"claude_code": "@anthropic-ai/claude-code", "codex": "@openai/codex"}
MODEL = "agents"
CHECKPOINT = CACHE / "agents-checkpoint"
MAX_CONTEXT = 32768
PROMPTS = ("List the files in the current directory, then say done.", "Thanks. Now say goodbye in one word.")
SCRIPTED_REPLY = "Done."
LLM_TIMEOUT = 300  # seconds for an `llm mlxs add` or `config`


def npm_install(claude: str, codex: str, *others: str) -> dict:
    """The CLIs, and `others` ("package@version") in the same command: npm removes from
    the prefix whatever a later --no-save install does not name."""
    NPM.mkdir(parents=True, exist_ok=True)
    cmd = ["npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(NPM),
           f"{PACKAGES['claude_code']}@{claude}", f"{PACKAGES['codex']}@{codex}", *others]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=900)
    return versions()


def versions() -> dict:
    return {name: npm_version(pkg) for name, pkg in PACKAGES.items()}


def npm_version(package: str) -> str | None:
    try:
        return json.loads((NPM / "node_modules" / package / "package.json").read_text())["version"]
    except OSError:
        return None


def run(cmd: list[str], *, env: dict, cwd: Path, timeout: int = CLI_TIMEOUT, stdin: str = "") -> dict:
    """Run a client in its own process group under a timeout; the group is killed after."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, text=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        out, err = proc.communicate()
    _kill_group(proc)  # anything it left behind
    return {"cmd": cmd, "rc": proc.returncode, "timed_out": timed_out,
            "seconds": round(time.monotonic() - start, 1), "stdout": out[-4000:], "stderr": err[-4000:]}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def base_env(home: Path) -> dict:
    """A minimal environment: nothing of this machine's own env leaks into a run."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "USER": "user",
        "LOGNAME": "user", "SHELL": "/bin/bash", "LANG": "C.UTF-8", "TERM": "dumb", "TZ": "UTC",
        "NO_COLOR": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }


def claude_quiet(home: Path) -> dict:
    """Claude Code's config dir in the scratch HOME, and nothing sent anywhere but the server."""
    env = {
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
    }
    if os.geteuid() == 0:  # --dangerously-skip-permissions refuses root outside a sandbox
        env["IS_SANDBOX"] = "1"
    return env


def codex_flags(sandbox: str) -> tuple[list[str], list[str]]:
    """`codex exec`'s flags, and `codex exec resume`'s (it has no -s: the same sandbox
    through the config)."""
    bypass = ["--dangerously-bypass-approvals-and-sandbox"]
    first = ["--skip-git-repo-check", *(bypass if sandbox == "bypass" else ["-s", sandbox])]
    resume = ["--skip-git-repo-check", *(bypass if sandbox == "bypass" else ["-c", f'sandbox_mode="{sandbox}"'])]
    return first, resume


def make_scratch(prefix: str) -> dict:
    """A scratch HOME with a small project in it (what the tools list and read)."""
    # Outside any git repository (Claude Code and Codex describe the repository they run
    # in), so in the system temp dir.
    work = Path(tempfile.mkdtemp(prefix=prefix))
    paths = {"work": work, "home": work / "home", "project": work / "home" / "project"}
    paths["project"].mkdir(parents=True)
    (paths["project"] / "README.md").write_text("# demo\n\nA tiny project for the recorder.\n")
    (paths["project"] / "hello.py").write_text('print("hello")\n')
    return paths


def build_checkpoint() -> Path:
    from fixtures.factory import build_checkpoint

    return build_checkpoint(CHECKPOINT, "qwen3_moe", tool_template=True, tokenizer_kind="bpe32k",
                            max_position_embeddings=MAX_CONTEXT)


def llm(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "llm", *args], check=True, timeout=LLM_TIMEOUT)


def add_model(checkpoint: Path, max_tokens: int) -> None:
    """The checkpoint as MODEL in the current llm user dir (LLM_USER_PATH), with a context
    that holds an agent's prompts and replies of at most `max_tokens`."""
    llm("mlxs", "add", str(checkpoint), "--name", MODEL)
    llm("mlxs", "config", "max_context", str(MAX_CONTEXT))
    llm("mlxs", "config", "max_tokens", str(max_tokens))


class ScriptedServer:
    """A server in this process whose every reply is forced: `script(tokenizer, ask,
    prepared)` gives its token ids from the request (reply.build.Ask) and what the
    checkpoint's template made of it (reply.build.Prepared); by default SCRIPTED_REPLY,
    then the end of the turn."""

    def __init__(self, model_id: str, script=None):
        from fixtures.scripted import Force
        from llm_mlx_streaming.reply import core
        from llm_mlx_streaming.server.process.run import Server

        self.script = script or done
        self.core, self.real_prepare = core, core.prepare

        def prepare(tokenizer, run, ask, grammar):  # the reply core renders each request with it
            prepared = self.real_prepare(tokenizer, run, ask, grammar)
            prepared.request.logits_processors.append(Force(self.script(tokenizer, ask, prepared)))
            return prepared

        core.prepare = prepare
        self.server = Server(port=0, model=model_id, any_model=True).start()

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.server.stop()
        self.core.prepare = self.real_prepare


def done(tokenizer, ask, prepared) -> list[int]:
    """SCRIPTED_REPLY and the end of a turn in Qwen's template, whatever was asked."""
    return tokenizer.encode(SCRIPTED_REPLY) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def launch_turns(client: str, sandbox: str) -> list[list[str]]:
    """The agent's arguments for each of the two PROMPTS, after `llm mlxs launch CLIENT MODEL --`."""
    if client == "claude":
        first = ["-p", PROMPTS[0], "--dangerously-skip-permissions"]
        return [first, ["-p", PROMPTS[1], "--continue", "--dangerously-skip-permissions"]]
    flags, resume = codex_flags(sandbox)
    return [["exec", *flags, PROMPTS[0]], ["exec", "resume", "--last", *resume, PROMPTS[1]]]


def launch_env(client: str, home: Path, max_tokens: int) -> dict:
    """What `llm mlxs launch CLIENT` runs under: the CLIs on PATH, this llm user dir and
    this checkout's package."""
    env = base_env(home) | {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                            "LLM_USER_PATH": os.environ["LLM_USER_PATH"], "PYTHONPATH": os.environ["PYTHONPATH"]}
    if client == "claude":
        env |= claude_quiet(home) | {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_tokens)}
    return env
