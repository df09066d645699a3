"""The live agents: Claude Code and Codex from the npm registry, each for two turns (the
second continuing the first session), through `llm mlxs launch`, against a server of
the tool-template checkpoint with the realistic tokenizer. Not run in CI.

    python benchmarks/agents.py [--no-install] [--replies scripted,model] [--max-tokens 32]
        [--timeout 240] [--claude-version latest] [--codex-version latest] [--keep-scratch]

What it does:

1. Installs the CLIs into benchmarks/.cache/npm (benchmarks/agent_clis.py) and builds the
   checkpoint (qwen3_moe, Qwen's tool template, the 32k-token BPE tokenizer, 32,768
   positions) into benchmarks/.cache/agents-checkpoint.
2. For each kind of replies, in a scratch llm user dir: `llm mlxs add` it as `agents`,
   `llm mlxs config max_context 32768` and `max_tokens N`, and a server for it, so both
   turns of a client meet the same KV cache:
   - `scripted`: the server runs in this process and every reply is forced to "Done."
     and the end of the turn (fixtures.scripted.Force), as a trained model would end it:
     random weights never end a turn, and Claude Code takes a reply cut at its
     max_tokens as an error (exit 1). The clients, their requests, the server and its KV
     cache are the real ones.
   - `model`: the random model's own replies, from a server started in the background as
     `llm mlxs launch` starts one. Each reply is bounded: Codex sends no output limit,
     so the server's `max_tokens` applies; Claude Code sends its own (32,000), which a
     request's field wins over, so it is told CLAUDE_CODE_MAX_OUTPUT_TOKENS=N.
3. Runs `llm mlxs launch claude agents -- -p PROMPT` and then `... -- -p PROMPT
   --continue`; `llm mlxs launch codex agents -- exec PROMPT` and then `... -- exec resume
   --last PROMPT`; each launch finds the running server and uses it.
4. Reads each turn's generations from the server (/dashboard/snapshot's last responses)
   and prints per client and turn: the exit status, whether the turn completed, the
   generations it took, the prompt tokens of the first (the request that opens the
   turn), the tokens of it reused from the KV cache (in turn 2, also as a share of turn
   1's prompt), its time to first token.

Target (issue 33): both clients complete both turns with exit 0, and the second turn
reuses at least 90% of the first turn's prompt from the KV cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # agent_clis, beside it
from agent_clis import (MAX_CONTEXT, MODEL, ROOT, ScriptedServer, add_model, build_checkpoint,  # noqa: E402
                        launch_env, launch_turns, make_scratch, npm_install, run, versions)

sys.path.insert(0, str(ROOT))
TARGET_REUSE = 0.9


def generations(server, after: int) -> list[dict]:
    """The server's finished generations numbered above `after`."""
    return [r for r in server.snapshot().get("recent") or [] if r["n"] > after]


def run_client(client: str, server, scratch: dict, args) -> list[dict]:
    rows = []
    env = launch_env(client, scratch["home"], args.max_tokens)
    for turn, agent_args in enumerate(launch_turns(client, args.codex_sandbox), 1):
        seen = max([r["n"] for r in generations(server, 0)], default=0)
        result = run([sys.executable, "-m", "llm", "mlxs", "launch", client, MODEL, "--", *agent_args],
                     env=env, cwd=scratch["project"], timeout=args.timeout)
        made = generations(server, seen)
        main = min(made, key=lambda r: r["n"], default={})  # the request that opens the turn
        rows.append({"client": client, "turn": turn, "rc": result["rc"], "timed_out": result["timed_out"],
                     "seconds": result["seconds"], "requests": len(made), "prompt": main.get("prompt_tokens"),
                     "reused": main.get("reused_tokens"), "ttft": main.get("ttft_seconds"),
                     "finish": main.get("finish_reason"), "stdout": result["stdout"], "stderr": result["stderr"]})
    return rows


def run_pass(replies: str, checkpoint: Path, args) -> list[dict]:
    """Both clients, two turns each, on a fresh llm user dir and server."""
    from llm_mlx_streaming import discovery
    from llm_mlx_streaming.cli.background import model_id, serve
    from llm_mlx_streaming.client.client import ServerClient

    scratch = make_scratch("live-agents-")
    os.environ["LLM_USER_PATH"] = str(scratch["work"] / "llm")
    add_model(checkpoint, args.max_tokens)
    print(f"\n{replies} replies, llm user dir {os.environ['LLM_USER_PATH']}", flush=True)
    server = ScriptedServer(model_id(MODEL)) if replies == "scripted" else serve(MODEL, wait=600)
    try:
        client = ServerClient(discovery.read())
        rows = run_client("claude", client, scratch, args) + run_client("codex", client, scratch, args)
    finally:
        server.close()
    if not args.keep_scratch:
        shutil.rmtree(scratch["work"], ignore_errors=True)
    for row in rows:
        row["replies"] = replies
        tail = [line for line in (row["stdout"] + row["stderr"]).splitlines() if line.strip()][-3:]
        print(f"{row['client']} turn {row['turn']}: rc={row['rc']} {row['seconds']} s, "
              f"finish {row['finish']}: {' | '.join(tail)[:400]}")
    return rows


def report(rows: list[dict]) -> dict:
    """The table (markdown), and whether the target holds, by kind of replies."""
    print("\n| replies | client | turn | exit | completed | generations | prompt tokens | reused from the KV cache "
          "| of turn 1's prompt | TTFT s | s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    met = {row["replies"]: True for row in rows}
    for row in rows:
        first = next(r for r in rows if r["replies"] == row["replies"] and r["client"] == row["client"]
                     and r["turn"] == 1)
        completed = row["rc"] == 0 and not row["timed_out"] and row["requests"] > 0
        share = None
        if row["turn"] > 1 and row["reused"] is not None and first["prompt"]:
            share = row["reused"] / first["prompt"]
        met[row["replies"]] &= completed and (row["turn"] == 1 or (share or 0) >= TARGET_REUSE)
        print(f"| {row['replies']} | {'Claude Code' if row['client'] == 'claude' else 'Codex'} | {row['turn']} "
              f"| {'timeout' if row['timed_out'] else row['rc']} | {'yes' if completed else 'no'} | {row['requests']} "
              f"| {_n(row['prompt'])} | {_n(row['reused'])} | {f'{share:.1%}' if share is not None else '-'} "
              f"| {_n(row['ttft'], '.2f')} | {row['seconds']} |")
    return met


def _n(value, spec: str = ",") -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replies", default="scripted,model", help="scripted and/or model (see above)")
    ap.add_argument("--claude-version", default="latest")
    ap.add_argument("--codex-version", default="latest")
    ap.add_argument("--codex-sandbox", default="workspace-write",
                    help="read-only | workspace-write | danger-full-access | bypass")
    ap.add_argument("--no-install", action="store_true", help="use what benchmarks/.cache holds")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per reply, at most")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per turn")
    ap.add_argument("--keep-scratch", action="store_true")
    args = ap.parse_args()

    if not args.no_install:
        npm_install(args.claude_version, args.codex_version)
    checkpoint = build_checkpoint()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    rows = [row for replies in args.replies.split(",") for row in run_pass(replies, checkpoint, args)]
    print(f"\nclients: {versions()}; replies at most {args.max_tokens} tokens; max_context {MAX_CONTEXT}")
    met = report(rows)
    print()
    for replies, ok in met.items():
        print(f"{replies} replies: target {'met' if ok else 'MISSED'} (both turns exit 0, turn 2 reuses "
              f">= {TARGET_REUSE:.0%} of turn 1's prompt)")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
