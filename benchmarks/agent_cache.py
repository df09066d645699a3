"""An agent's prompt read once: the tokens `llm mlxs serve` reuses, per architecture class
and per pattern of an agent's traffic, against a cold prefill, through `/v1/messages` as
Claude Code sends it.

    python benchmarks/agent_cache.py [--interleave] [ARCH ...]

Each architecture is a tiny random checkpoint (8 experts, top-2) with a tool template and
a 32k BPE vocabulary, served by the real server. The requests are Claude Code's recorded
first request (tests/data/traffic/claude_code_turn1.json): its billing line, a ~750-token
agent prompt (its system blocks cut down) and two of its tools, then:

- A1: a task (the first request of a session);
- A2 same line: the session's next turn with the billing line unchanged (`claude -p`);
- A2 new cch: the same with a new `cch` nonce (interactive Claude Code, every request);
- B1: a new session (a new version hash), a new task;
- B1 after side: a new session after an unrelated request (another system prompt);
- C1: a new session whose billing line is exactly A1's, a new task;
- restart: a new session after the server restarted (its conversation cache on disk kept).

For each: the prompt's tokens, the prefix it shares with what the server saw before (the
whole earlier prompt for A2; for a new session the system prompt, the tools and the user
turn's header, counted as a one-message request's tokens less TAIL), the tokens
reused and from where, and the request's time against the same request on a server with
no cache (conversation cache and snapshots off, its prompt cache emptied before each
request), one token generated.

Then the interleave pattern (issue 56; only it with --interleave): three agents on the
model, each with a ~1.5k-token system prompt of its own (Claude Code's, opened by the
agent's name) and Claude Code's two tools, their turns interleaved A1 B1 C1 A2 B2 C2 ...
(ROUNDS per agent), each later turn the agent's previous prompt, its reply (four tokens
at most) and a new user message, on a checkpoint of wider attention (WIDE: 4 layers of 4
KV heads of 64, float32: 8 KB of KV cache per token, so a conversation's cache is about
20 MB). A second table, the later turns' medians: as the server runs them (the previous
prompt from memory), and with the model's prompt cache emptied before each request (from
the conversation cache on disk, where a server that kept one conversation per model found
it); "s cold" is the same turns on a server with no cache; "CPU s" is the process's CPU
time for the request (the server runs in it), steadier than wall time on a shared machine.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.factory import build_checkpoint  # noqa: E402
from fixtures.traffic import load  # noqa: E402

CLASSES = {  # architecture -> its class of cache
    "qwen3_moe": "attention",
    "qwen3_next": "hybrid linear",
    "qwen3_5_moe": "hybrid linear",
    "gpt_oss": "sliding window",
    "gemma4_text": "sliding window",
    "llama4": "chunked",
}
WIDE = dict(hidden_size=128, num_layers=4, head_dim=64, num_attention_heads=4, num_key_value_heads=4)
ROUNDS = 5  # the interleave pattern's turns per agent
TAIL = 6  # a one-letter user message's tokens past its turn's header: "x<|im_end|>\n<|im_start|>assistant\n"
LINE = "x-anthropic-billing-header: cc_version=2.1.332.{version}; cc_entrypoint=cli;{nonce}"


def body(version: str, nonce: str, messages: list, system_text: str | None = None) -> dict:
    recorded = load("claude_code_turn1")["body"]
    out = copy.deepcopy(recorded)
    blocks = [{**block, "text": block["text"][:1100]} for block in recorded["system"][1:]]
    if system_text is not None:
        blocks = [{"type": "text", "text": system_text}]
    out["system"] = [{"type": "text", "text": LINE.format(version=version, nonce=f" cch={nonce};" if nonce else "")},
                     *blocks]
    out["tools"] = [{**tool, "description": tool["description"][:400]} for tool in recorded["tools"][:2]]
    out.update(model="bench", messages=messages, max_tokens=1, stream=False)
    return out


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


def post(url: str, path: str, data: dict) -> tuple[dict, float]:
    request = urllib.request.Request(url + path, data=json.dumps(data).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.loads(response.read())
    return reply, time.perf_counter() - start


class Served:
    """`llm mlxs serve` for one checkpoint in its own llm user dir, in this process."""

    def __init__(self, user_dir: Path, path: Path, cached: bool):
        self.user_dir, self.path, self.cached = user_dir, path, cached

    def __enter__(self):
        import os

        from llm_mlx_streaming.server.process.run import Server

        os.environ["LLM_USER_PATH"] = str(self.user_dir)
        self.user_dir.mkdir(parents=True, exist_ok=True)
        settings = {"default_model": "bench", "max_context": 8192, "max_batch": 1,
                    "models": {"bench": {"path": str(self.path), "expert_slots": 8}}}
        if not self.cached:
            settings.update(conversation_cache=False, snapshots=0)
        (self.user_dir / "mlx-streaming.json").write_text(json.dumps(settings))
        self.server = Server(port=0).start()
        return self

    def __exit__(self, *exc):
        from llm_mlx_streaming.engine.manager import get_manager

        self.server.stop()
        get_manager().unload()  # a restart: nothing of this engine is left in memory

    def ask(self, data: dict) -> tuple[dict, float]:
        return post(self.server.url, "/v1/messages", data)

    def count(self, data: dict) -> int:
        keys = ("model", "system", "tools", "messages")
        return post(self.server.url, "/v1/messages/count_tokens", {k: data[k] for k in keys})[0]["input_tokens"]


def patterns() -> list[tuple[str, dict, str]]:
    """(pattern, request, what it shares: "previous" or "system") in the order sent."""
    first = user("List the files in the current directory (use a tool), then say done.")
    turn = [*first, {"role": "assistant", "content": [{"type": "text", "text": "Done: README.md, src/."}]},
            *user("Thanks. Now say goodbye in one word.")]
    return [
        ("A1", body("307", "a1b2c", first), "none"),
        ("A2 same line", body("307", "a1b2c", turn), "previous"),
        ("A2 new cch", body("307", "f00d5", turn + [{"role": "assistant", "content": "Bye."}] +
                            user("One more: the date?")), "previous"),
        ("B1", body("344", "9e8d7", user("Show the current date (use a tool), then say done.")), "system"),
        ("side", body("1c9", "", user("Summarise this title."), system_text="You write short titles."), "none"),
        ("B1 after side", body("5ab", "0c0c0", user("Count the lines of README.md (use a tool).")), "system"),
        ("C1", body("307", "a1b2c", user("Which shell runs here? (use a tool)")), "system"),
        ("restart", body("e42", "77aa1", user("Print the working directory (use a tool).")), "system"),
    ]


def agent_body(agent: str, messages: list) -> dict:
    """Agent `agent`'s request: its own system prompt, Claude Code's two tools, up to 4 tokens."""
    recorded = load("claude_code_turn1")["body"]
    text = "\n".join(block["text"] for block in recorded["system"][1:])[:5200]
    out = body("000", "", messages, system_text=f"You are agent {agent}, one of three on this repository.\n{text}")
    out["system"] = out["system"][1:]  # no billing line
    out["max_tokens"] = 4
    return out


def forget() -> None:
    """Empty the model's prompt cache (between requests: the engine is idle)."""
    from llm_mlx_streaming.engine.manager import get_manager

    if get_manager().prompts is not None:
        get_manager().prompts.reset()


def sources(served: Served) -> dict:
    """The tokens reused so far, by where they came from (/metrics)."""
    with urllib.request.urlopen(served.server.url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("mlxs_reused_tokens_by_source_total{"):
            found[line.split('source="')[1].split('"')[0]] = float(line.split()[-1])
    return found


def interleave(served: Served, empty_first: bool = False) -> list[dict]:
    """The turns A1 B1 C1 A2 ... (ROUNDS of them per agent), each {"prompt", "shared",
    "reused", "from", "s", "cpu"} ("cpu": this process's CPU seconds, the server's threads
    included, steadier than "s" on a shared machine); `empty_first`: the model's prompt
    cache is emptied before each request (only the disk, if any, keeps them)."""
    chats = {agent: user(f"Agent {agent}: list the files of src/ (use a tool).") for agent in "ABC"}
    held, turns = {}, []
    for turn in range(ROUNDS):
        for agent in "ABC":
            if empty_first:
                forget()
            before, cpu = sources(served), time.process_time()
            reply, seconds = served.ask(agent_body(agent, chats[agent]))
            cpu = time.process_time() - cpu
            after = sources(served)
            usage = reply["usage"]
            prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
            came = [k for k in after if after[k] > before.get(k, 0)]
            turns.append({"prompt": prompt, "shared": held.get(agent, 0), "reused": usage["cache_read_input_tokens"],
                          "from": "/".join(came) or "-", "s": seconds, "cpu": cpu})
            held[agent] = prompt + usage["output_tokens"]
            chats[agent] = [*chats[agent], {"role": "assistant", "content": reply["content"] or "."},
                            *user(f"Step {turn + 2}: go on.")]
    return turns


def interleave_rows(arch: str, root: Path) -> list[list]:
    """The interleave pattern's later turns from memory and from disk, against cold: medians."""
    from statistics import median

    path = build_checkpoint(root / f"{arch}-wide", arch, num_experts=8, top_k=2, tool_template=True,
                            tokenizer_kind="bpe32k", max_position_embeddings=8192, **WIDE)
    with Served(root / f"{arch}-interleave-cold", path, cached=False) as cold:
        cold_turns = interleave(cold, empty_first=True)[3:]
    rows = []
    for empty_first in (False, True):
        with Served(root / f"{arch}-interleave-{empty_first}", path, cached=True) as served:
            later = interleave(served, empty_first)[3:]
        middle = lambda key, turns=later: median(t[key] for t in turns)  # noqa: E731
        rows.append([arch, CLASSES.get(arch, "?"), ", ".join(sorted({t["from"] for t in later})),
                     round(middle("prompt")), round(middle("shared")), round(middle("reused")),
                     f"{sum(t['reused'] for t in later) / sum(t['shared'] for t in later):.0%}",
                     f"{middle('s'):.3f}", f"{middle('cpu'):.3f}", f"{middle('s', cold_turns):.2f}",
                     f"{middle('cpu', cold_turns):.2f}"])
    return rows


def run(arch: str, root: Path) -> list[list]:
    path = build_checkpoint(root / arch, arch, num_experts=8, top_k=2, tool_template=True, tokenizer_kind="bpe32k",
                            max_position_embeddings=8192)
    rows, previous = [], 0
    cold_times = {}
    with Served(root / f"{arch}-cold", path, cached=False) as cold:
        for name, data, _ in patterns():
            forget()  # nothing in memory: the next prompt is prefilled cold
            cold_times[name] = cold.ask(data)[1]
    served = Served(root / f"{arch}-llm", path, cached=True)
    served.__enter__()
    try:
        for name, data, shares in patterns():
            if name == "restart":
                served.__exit__()
                served.__enter__()
            system = served.count({**data, "messages": user("x")}) - TAIL
            reply, seconds = served.ask(data)
            usage = reply["usage"]  # Anthropic's input_tokens are the ones not read from the cache
            prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
            shared = {"previous": previous, "system": system, "none": 0}[shares]
            previous = prompt
            if name in ("A1", "side"):
                continue
            reused = usage["cache_read_input_tokens"]
            rows.append([arch, CLASSES.get(arch, "?"), name, prompt, shared, reused,
                         f"{reused / shared:.0%}" if shared else "-", f"{seconds:.2f}", f"{cold_times[name]:.2f}"])
    finally:
        served.__exit__()
    return rows


def table(head: list[str], rows) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |", flush=True)


def main(archs: list[str], patterns_too: bool = True) -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        if patterns_too:
            table(["architecture", "class", "pattern", "prompt", "shared", "reused", "of shared", "s", "s cold"],
                  (row for arch in archs for row in run(arch, Path(root))))
            print()
        table(["architecture", "class", "later turns from", "prompt", "shared", "reused", "of shared", "s",
               "CPU s", "s cold", "CPU s cold"], (row for arch in archs for row in interleave_rows(arch, Path(root))))
    print(f"\n{len(archs)} architectures, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    args = sys.argv[1:]
    only = "--interleave" in args
    archs = [a for a in args if a != "--interleave"]
    main(archs or list(CLASSES), patterns_too=not only)
