"""Claude Code and Codex from the npm registry, run non-interactively in a scratch HOME:
what benchmarks/record_agents.py and benchmarks/agents.py share.

The CLIs go into benchmarks/.cache/npm (an explicit tag: with an old node, a bare name
makes npm pick an older release whose `engines` match; the CLIs ship native binaries,
so node's version does not matter to them). Each run is in its own process group under
a timeout, killed at the end, with the clients' telemetry, update checks and
nonessential traffic switched off.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache"
NPM = CACHE / "npm"
BIN = NPM / "node_modules" / ".bin"  # `claude`, `codex`
CLI_TIMEOUT = 240  # seconds per CLI invocation
PACKAGES = {"claude_code": "@anthropic-ai/claude-code", "codex": "@openai/codex"}


def npm_install(claude: str, codex: str) -> dict:
    NPM.mkdir(parents=True, exist_ok=True)
    cmd = ["npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(NPM),
           f"{PACKAGES['claude_code']}@{claude}", f"{PACKAGES['codex']}@{codex}"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=900)
    return versions()


def versions() -> dict:
    out = {}
    for name, pkg in PACKAGES.items():
        try:
            out[name] = json.loads((NPM / "node_modules" / pkg / "package.json").read_text())["version"]
        except OSError:
            out[name] = None
    return out


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
