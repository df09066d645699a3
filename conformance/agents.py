"""The live agents: Claude Code and Codex from the npm registry, each for two turns (the
second continuing the first session), through `llm mlxs launch`, against a server of
the tool-template checkpoint with the realistic tokenizer, or of a model family's own
chat format. Not run in CI.

    python conformance/agents.py [--no-install] [--replies scripted,model] [--max-tokens 32]
        [--timeout 240] [--claude-version latest] [--codex-version latest] [--keep-scratch]
    python conformance/agents.py --family all    # or --family gpt_oss --family kimi_k2, or a,b

What it does:

1. Installs the CLIs into conformance/.cache/npm (conformance/agent_clis.py) and builds the
   checkpoint (qwen3_moe, Qwen's tool template, the 32k-token BPE tokenizer, 32,768
   positions) into conformance/.cache/agents-checkpoint.
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

With `--family NAME` (a key of fixtures/families.py's FAMILIES; `all`: Qwen3-Coder,
gpt-oss, GLM-4.6, DeepSeek-V3.1 and Kimi-K2), the checkpoint is that family's (its real
chat template and special tokens, built into conformance/.cache/agents-NAME) and each
reply is forced to what the family's model writes (fixtures.families.native_reply),
decided from the request the server renders: while the conversation ends with the
user's prompt, a call of the client's shell tool in the family's own markup (Claude
Code's `Bash` {"command": "ls", ...}, Codex's `exec_command` {"cmd": "ls"}), led by a
short reasoning block where the model reasons after that generation prompt; once tool
results follow the last reply, the final answer "Done."; a request without the shell
tool (Claude Code's titles and summaries) gets the plain answer. Each turn must exit 0,
show the model the shell tool in every prompt that offers it (its name and the start of
its description are in the rendered prompt: a forced call would succeed without), run
the tool (a request after the call carries `ls`'s output: the scratch project's
hello.py) and print the answer alone, "Done." (no markup of the format). Prints per
family, client and turn the exit status, these checks, the generations and the replies
forced, then the table for docs/server.md ("Coding agents"), with the prompt tokens of
the turn's first request and those of them reused from the KV cache; exits 1 on a FAIL.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # agent_clis, beside it
from agent_clis import (CACHE, MAX_CONTEXT, MODEL, ROOT, SCRIPTED_REPLY, ScriptedServer, add_model,  # noqa: E402
                        build_checkpoint, launch_env, launch_turns, make_scratch, npm_install, run, versions)

sys.path.insert(0, str(ROOT))
from fixtures.families import FAMILIES, build_family_checkpoint, end_of_turn, native_reply  # noqa: E402

TARGET_REUSE = 0.9
FIVE = ("qwen3_coder", "gpt_oss", "glm46", "deepseek_v31", "kimi_k2")  # --family all
SHELL_CALLS = {  # the clients' shell tools (tests/data/traffic: the tools of their first request)
    "Bash": {"command": "ls", "description": "List files"},  # Claude Code
    "exec_command": {"cmd": "ls"},  # Codex
}
THOUGHT = "The user wants the files listed: I will run ls."
LISTED = "hello.py"  # in the scratch project: a tool result that names it is `ls`'s output
FAMILY_MAX_TOKENS = 256  # a call in the family's markup, with its reasoning, fits


def generations(server, after: int) -> list[dict]:
    """The server's finished generations numbered above `after`."""
    return [r for r in server.snapshot().get("recent") or [] if r["n"] > after]


class FamilyScript:
    """The replies of `family`'s model to an agent, decided per request from what it
    holds (see the module's doc); `log` keeps one entry per generation: the kind of
    reply forced and whether it reasons, the tool results the request carried, the
    text, and whether the prompt declared the shell tool it offered."""

    def __init__(self, family: str):
        self.family = family
        self.log: list[dict] = []

    def __call__(self, tokenizer, ask, prepared) -> list[int]:
        shell = [spec for spec in ask.tools if tool_name(spec) in SHELL_CALLS]
        results = tool_results(ask.messages)
        reasoning = THOUGHT if reasons(self.family, prepared.generation_prompt) else None
        if shell and not results:
            name = tool_name(shell[0])
            kind, calls, text = "call", [(name, SHELL_CALLS[name])], None
        else:
            kind, calls, text = "answer" if results else "plain", [], SCRIPTED_REPLY
        reply = native_reply(self.family, reasoning=reasoning, calls=calls, text=text)
        prompt = tokenizer.decode(prepared.request.prompt)
        self.log.append({"reply": kind, "reasoning": reasoning is not None, "results": results, "text": reply,
                         "declared": all(declared(spec, prompt) for spec in shell)})
        return tokenizer.encode(reply, add_special_tokens=False) + [end_of_turn(self.family, tokenizer, bool(calls))]


def tool_name(spec: dict) -> str:
    return spec.get("function", spec).get("name", "")


def declared(spec: dict, prompt: str) -> bool:
    """Whether the rendered prompt shows the model the tool: its name and the plain
    words its description starts with."""
    function = spec.get("function", spec)
    lead = re.match(r"[\w ,.]*", function.get("description") or "").group()[:40]
    return function["name"] in prompt and lead in prompt


def tool_results(messages) -> list[str]:
    """The outputs of the tool results after the conversation's last reply."""
    after = []
    for message in messages:
        if message.role == "assistant":
            after = []
        elif message.role == "tool":
            after += [str(getattr(part, "output", "")) for part in message.parts]
    return after


def reasons(family: str, generation_prompt: str) -> bool:
    """Whether `family`'s model writes reasoning after this generation prompt: gpt-oss
    always does (its analysis channel); in a think block the prompt opened it does, after
    one the prompt closed (reasoning switched off) it does not; otherwise GLM opens its
    own, and DeepSeek-V3.1 answers tool results without one."""
    if not FAMILIES[family].reasons:
        return False
    if family == "gpt_oss":
        return True
    opened = generation_prompt.rfind("<think>")
    if opened >= 0:
        return "</think>" not in generation_prompt[opened:]
    return "</think>" not in generation_prompt and not family.startswith("deepseek")


def run_client(client: str, server, scratch: dict, args, log: list | None = None) -> list[dict]:
    """The client's two turns; with `log` (a FamilyScript's), each turn's entries of it."""
    rows = []
    env = launch_env(client, scratch["home"], args.max_tokens)
    for turn, agent_args in enumerate(launch_turns(client, args.codex_sandbox), 1):
        seen = max([r["n"] for r in generations(server, 0)], default=0)
        logged = len(log or [])
        result = run([sys.executable, "-m", "llm", "mlxs", "launch", client, MODEL, "--", *agent_args],
                     env=env, cwd=scratch["project"], timeout=args.timeout)
        made = generations(server, seen)
        main = min(made, key=lambda r: r["n"], default={})  # the request that opens the turn
        rows.append({"client": client, "turn": turn, "rc": result["rc"], "timed_out": result["timed_out"],
                     "seconds": result["seconds"], "requests": len(made), "prompt": main.get("prompt_tokens"),
                     "reused": main.get("reused_tokens"), "ttft": main.get("ttft_seconds"),
                     "finish": main.get("finish_reason"), "stdout": result["stdout"], "stderr": result["stderr"],
                     "forced": (log or [])[logged:]})
    return rows


def run_pass(label: str, checkpoint: Path, start_server, args, log: list | None = None) -> list[dict]:
    """Both clients, two turns each, on a fresh llm user dir and the server
    `start_server(model_id)` starts."""
    from llm_mlx_streaming import discovery
    from llm_mlx_streaming.cli.background import model_id
    from llm_mlx_streaming.client.client import ServerClient

    scratch = make_scratch("live-agents-")
    os.environ["LLM_USER_PATH"] = str(scratch["work"] / "llm")
    add_model(checkpoint, args.max_tokens)
    print(f"\n{label}, llm user dir {os.environ['LLM_USER_PATH']}", flush=True)
    server = start_server(model_id(MODEL))
    try:
        client = ServerClient(discovery.read())
        rows = run_client("claude", client, scratch, args, log) + run_client("codex", client, scratch, args, log)
    finally:
        server.close()
    if not args.keep_scratch:
        shutil.rmtree(scratch["work"], ignore_errors=True)
    for row in rows:
        tail = [line for line in (row["stdout"] + row["stderr"]).splitlines() if line.strip()][-3:]
        print(f"{row['client']} turn {row['turn']}: rc={row['rc']} {row['seconds']} s, "
              f"finish {row['finish']}: {' | '.join(tail)[:400]}")
    return rows


def replies_pass(replies: str, checkpoint: Path, args) -> list[dict]:
    """The tool-template checkpoint, its replies scripted or the random model's own."""
    from llm_mlx_streaming.cli.background import serve

    start = ScriptedServer if replies == "scripted" else lambda _: serve(MODEL, wait=600)
    rows = run_pass(f"{replies} replies", checkpoint, start, args)
    for row in rows:
        row["replies"] = replies
    return rows


def family_pass(family: str, args) -> list[dict]:
    """The family's checkpoint, its replies the family's own (FamilyScript)."""
    checkpoint = build_family_checkpoint(CACHE / f"agents-{family}", family, max_position_embeddings=MAX_CONTEXT)
    script = FamilyScript(family)
    rows = run_pass(f"family {family}", checkpoint, lambda model: ScriptedServer(model, script), args, script.log)
    for row in rows:
        row["family"] = family
        called = any(entry["reply"] == "call" for entry in row["forced"])
        row["tool_ran"] = called and any(LISTED in output for entry in row["forced"] for output in entry["results"])
        row["declared"] = all(entry["declared"] for entry in row["forced"])
        row["answered"] = row["stdout"].strip() == SCRIPTED_REPLY  # the answer's text alone, no markup
        row["ok"] = (row["rc"] == 0 and not row["timed_out"] and row["declared"] and row["tool_ran"]
                     and row["answered"])
        kinds = ", ".join(entry["reply"] + " after reasoning" * entry["reasoning"] for entry in row["forced"])
        output = next((out for entry in row["forced"] for out in entry["results"]), "")
        print(f"{family} {row['client']} turn {row['turn']}: exit {row['rc']}, tools in the prompt "
              f"{row['declared']}, tool ran {row['tool_ran']}, printed the answer {row['answered']}, "
              f"{len(row['forced'])} generations ({kinds}): {'ok' if row['ok'] else 'FAIL'}; "
              f"the tool's output {' '.join(output.split())[-80:]!r}", flush=True)
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


def family_report(rows: list[dict]) -> bool:
    """The table (markdown) of the family passes, and whether every turn is ok."""
    print("\n| family | client | turn | exit | tools in the prompt | tool ran | printed the answer | generations "
          "| prompt tokens | reused from the KV cache | result |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['family']} | {'Claude Code' if row['client'] == 'claude' else 'Codex'} | {row['turn']} "
              f"| {'timeout' if row['timed_out'] else row['rc']} | {'yes' if row['declared'] else 'no'} "
              f"| {'yes' if row['tool_ran'] else 'no'} | {'yes' if row['answered'] else 'no'} "
              f"| {len(row['forced'])} | {_n(row['prompt'])} | {_n(row['reused'])} | {'ok' if row['ok'] else 'FAIL'} |")
    return all(row["ok"] for row in rows)


def families_of(values: list[str]) -> list[str]:
    names = [name for value in values for name in value.split(",") if name]
    names = [f for name in names for f in (FIVE if name == "all" else [name])]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        sys.exit(f"--family: unknown {', '.join(unknown)}; choose from all, {', '.join(sorted(FAMILIES))}")
    return list(dict.fromkeys(names))


def _n(value, spec: str = ",") -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replies", default="scripted,model", help="scripted and/or model (see above)")
    ap.add_argument("--family", action="append", default=[],
                    help="a family's own format instead of --replies (repeatable, or a,b; all: the five)")
    ap.add_argument("--claude-version", default="latest")
    ap.add_argument("--codex-version", default="latest")
    ap.add_argument("--codex-sandbox", default="workspace-write",
                    help="read-only | workspace-write | danger-full-access | bypass")
    ap.add_argument("--no-install", action="store_true", help="use what conformance/.cache holds")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help=f"tokens generated per reply, at most (32; {FAMILY_MAX_TOKENS} with --family)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per turn")
    ap.add_argument("--keep-scratch", action="store_true")
    args = ap.parse_args()
    families = families_of(args.family)
    args.max_tokens = args.max_tokens or (FAMILY_MAX_TOKENS if families else 32)

    start = time.monotonic()
    if not args.no_install:
        npm_install(args.claude_version, args.codex_version)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if families:
        rows = [row for family in families for row in family_pass(family, args)]
        print(f"\n{datetime.date.today()}: clients {versions()}; replies at most {args.max_tokens} tokens; "
              f"max_context {MAX_CONTEXT}; {time.monotonic() - start:.0f} s")
        return 0 if family_report(rows) else 1
    checkpoint = build_checkpoint()
    rows = [row for replies in args.replies.split(",") for row in replies_pass(replies, checkpoint, args)]
    print(f"\nclients: {versions()}; replies at most {args.max_tokens} tokens; max_context {MAX_CONTEXT}")
    met = report(rows)
    print()
    for replies, ok in met.items():
        print(f"{replies} replies: target {'met' if ok else 'MISSED'} (both turns exit 0, turn 2 reuses "
              f">= {TARGET_REUSE:.0%} of turn 1's prompt)")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
