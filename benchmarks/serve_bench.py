"""`llm mlxs serve`: one-shot `llm` prompts in-process against routed to a warm server,
and the server's throughput with several clients queued at once.

On the benchmark checkpoint (benchmarks/engine_bench.py's, 25% of each layer's experts
resident), ten one-shot `llm -m mlx-stream "..."` processes run in-process
(`-o server off`: each loads the model and starts with an empty pool), then ten
routed to a server started with the model loaded. Time to first token is measured
from the process start to its first byte on stdout, as a user sees it; MB read per
call and the engine's own time to first token (prefill, `ttft_seconds`) come from the
response's logged figures. Then N clients each send one request,
one after another and then all at once, alternating for a few rounds; total tokens/s of
the two are compared.

`--against DIR` measures the server's own overhead instead, side by side with the
package in DIR (a checkout of an earlier commit, e.g. `git worktree add`): each tree's
server is started in turn, rounds alternating, and asked for a short streamed reply
one at a time (time to its first token, as a client sees it) and for many short
replies from `--clients` clients at once at max_batch 4 (requests per second).

    python benchmarks/serve_bench.py [--calls 10] [--tokens 16] [--clients 8] [--rounds 3] [--bundled]
    python benchmarks/serve_bench.py --against ../base [--calls 10] [--clients 8] [--rounds 3]

With --dashboard it measures the dashboard's cost instead: rounds of N requests one
after another, alternately with no dashboard and with one reading /dashboard/events
(the live figures' event stream) the whole round; it prints the engine's decode tok/s
(tokens over the engine's own decode seconds, /api/stats `totals`) of both and their
ratio, which should be 1 within noise.

    python benchmarks/serve_bench.py --dashboard [--clients 4] [--tokens 64] [--rounds 3] [--bundled]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_bench import CACHE, SHAPE  # noqa: E402  (the same checkpoint)

from fixtures.factory import build_checkpoint  # noqa: E402

PROMPTS = [
    "Tell me about solid state drives", "What is a B-tree?", "Name three file systems",
    "Why do caches help?", "Explain virtual memory", "What does an SSD controller do?",
    "How does a page cache work?", "What is write amplification?", "Describe NVMe briefly",
    "What is wear levelling?", "Explain mixture of experts", "What is a KV cache?",
]


def last_figures(user_dir: Path) -> dict:
    conn = sqlite3.connect(user_dir / "logs.db")
    try:
        row = conn.execute("select response_json from turns order by id desc limit 1").fetchone()
    finally:
        conn.close()
    return json.loads(row[0] or "{}")


def one_shot(llm_bin: Path, env: dict, user_dir: Path, prompt: str, tokens: int, extra: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen([str(llm_bin), "-m", "mlx-stream", prompt, "-o", "max_tokens", str(tokens), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - start
    proc.stdout.read()
    err = proc.stderr.read()
    if proc.wait() != 0 or not first:
        raise SystemExit(f"llm failed: {err.decode()[-500:]}")
    wall = time.perf_counter() - start
    figures = last_figures(user_dir)
    return {"ttft": ttft, "wall": wall, "mb": figures.get("mb_read") or 0.0, "served_by": figures.get("served_by"),
            "engine_ttft": figures.get("ttft_seconds") or 0.0}


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as resp:
        return json.loads(resp.read())


def throughput(url: str, prompts: list[str], tokens: int, at_once: bool,
               clients: Optional[int] = None) -> tuple[int, float]:
    """(tokens generated, wall seconds) for one request per prompt: one after another, or
    all at once from `clients` clients (default: one per prompt)."""
    counts: list[int] = []
    queue = list(prompts)

    def ask(prompt):
        body = {"model": "mlx-stream", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}
        counts.append(post(url, body)["usage"]["completion_tokens"])

    def client():
        while queue:
            ask(queue.pop())

    start = time.perf_counter()
    if at_once:
        threads = [threading.Thread(target=client) for _ in range(clients or len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for p in prompts:
            ask(p)
    return sum(counts), time.perf_counter() - start


def first_token_seconds(url: str, prompt: str, tokens: int) -> float:
    """Seconds from sending a streamed chat request to its first content chunk."""
    body = {"model": "mlx-stream", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "stream": True}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=600) as resp:
        for line in resp:
            if first is None and line.startswith(b"data:") and b'"content": "' in line and b'"content": ""' not in line:
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def overhead(llm_bin: Path, env: dict, user_dir: Path, trees: dict, args) -> None:
    """The server's overhead per tree: short-request TTFT and requests/s at max_batch 4."""
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.clients * 2)]
    results = {name: {"ttft": [], "rps": []} for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            server, url = start_server(llm_bin, {**env, "PYTHONPATH": str(tree)}, user_dir)
            try:
                first_token_seconds(url, "warm up", 2)
                results[name]["ttft"] += [first_token_seconds(url, p, 2) for p in prompts[:args.calls]]
                done, wall = throughput(url, prompts, 4, at_once=True, clients=args.clients)
                results[name]["rps"].append(len(prompts) / wall)
            finally:
                server.terminate()
                server.wait(30)
    print(f"\n{'server (median)':<28} {'short TTFT ms':>13} {'requests/s':>10} {'TTFT vs first':>13} {'req/s vs first':>14}")
    base = None
    for name in trees:
        ttft = statistics.median(results[name]["ttft"]) * 1000
        rps = statistics.median(results[name]["rps"])
        base = base or (ttft, rps)
        print(f"{name:<28} {ttft:>13.1f} {rps:>10.2f} {ttft / base[0]:>12.2f}x {rps / base[1]:>13.2f}x")


def totals(url: str) -> dict:
    with urllib.request.urlopen(url + "/api/stats", timeout=30) as resp:
        return json.loads(resp.read())["totals"]


class Dashboard:
    """A page's event stream, read on a thread while it is open (frames counted)."""

    def __init__(self, url: str) -> None:
        self.frames, self._stop = 0, threading.Event()
        self._resp = urllib.request.urlopen(url + "/dashboard/events", timeout=30)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                line = self._resp.readline()
                if not line:
                    return
                self.frames += line.startswith(b"data:")
        except (OSError, ValueError, AttributeError):  # closed under it by close()
            return

    def close(self) -> int:
        self._stop.set()
        frames = self.frames
        self._resp.close()
        self._thread.join(5)
        return frames


def dashboard_cost(url: str, prompts: list[str], tokens: int, rounds: int) -> None:
    """Decode tok/s with the dashboard closed and open, alternating, and their ratio."""
    throughput(url, prompts[:1], tokens, at_once=False)  # warm-up
    runs: dict[str, list] = {"closed": [], "open": []}
    frames = 0
    for _ in range(rounds):
        for mode in ("closed", "open"):
            page = Dashboard(url) if mode == "open" else None
            before = totals(url)
            generated, wall = throughput(url, prompts, tokens, at_once=False)
            after = totals(url)
            if page is not None:
                frames += page.close()
            decode = after["decode_seconds"] - before["decode_seconds"]
            runs[mode].append(((after["generated_tokens"] - before["generated_tokens"]) / decode, generated / wall))
    print(f"\n{'dashboard (median of ' + str(rounds) + ')':<26} {'decode tok/s':>12} {'wall tok/s':>10}")
    median = {m: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
              for m, rows in runs.items()}
    for mode, (decode, wall) in median.items():
        print(f"{mode:<26} {decode:>12.2f} {wall:>10.2f}")
    print(f"open / closed: decode {median['open'][0] / median['closed'][0]:.3f}x, wall "
          f"{median['open'][1] / median['closed'][1]:.3f}x ({frames} frames read while open; each round "
          f"{len(prompts)} requests of {tokens} tokens; per round open/closed decode: "
          + ", ".join(f"{o[0] / c[0]:.3f}" for c, o in zip(runs["closed"], runs["open"])) + ")")


def start_server(llm_bin: Path, env: dict, user_dir: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([str(llm_bin), "mlxs", "serve", "--port", "0", "-m", "mlx-stream"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    found = user_dir / "mlx-streaming" / "server.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if found.exists():
            info = json.loads(found.read_text())
            url = f"http://{info['host']}:{info['port']}"
            try:
                with urllib.request.urlopen(url + "/api/stats", timeout=5) as resp:
                    stats = json.loads(resp.read())
                if stats["state"] == "loaded" and not stats["rebuilding"]:
                    return proc, url
            except OSError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10, help="one-shot llm calls per mode")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per reply")
    parser.add_argument("--clients", type=int, default=8, help="clients queued at once")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the throughput pair (median reported)")
    parser.add_argument("--against", type=Path, help="a checkout whose server's overhead is measured beside this one's")
    parser.add_argument("--bundled", action="store_true",
                        help="the bundled (trained) demo model instead, 4 of its 16 experts per layer resident")
    parser.add_argument("--dashboard", action="store_true",
                        help="only the dashboard's cost: decode tok/s with /dashboard/events open vs closed")
    args = parser.parse_args()

    user_dir = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    env = {**os.environ, "LLM_USER_PATH": str(user_dir)}
    if args.bundled:
        experts, slots = 16, 4
        (user_dir / "mlx-streaming.json").write_text(json.dumps({"expert_slots": slots}))
        os.environ["LLM_USER_PATH"] = str(user_dir)
        from llm_mlx_streaming.checkpoints.default import default_checkpoint

        path = default_checkpoint()  # unpacked before any timing
    else:
        experts, slots = SHAPE["num_experts"], SHAPE["num_experts"] // 4
        path = build_checkpoint(CACHE / "qwen3_moe-bench", "qwen3_moe", quant="4bit", seed=0, **SHAPE)
        (user_dir / "mlx-streaming.json").write_text(json.dumps(
            {"default_model": "bench", "models": {"bench": {"path": str(path), "expert_slots": slots}}}))
    llm_bin = Path(sys.executable).parent / "llm"
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.calls)]
    print(f"checkpoint {path}, {slots} of {experts} experts per layer resident (25%), "
          f"{args.tokens} tokens per reply")

    if args.against:
        here = Path(__file__).resolve().parents[1]
        overhead(llm_bin, env, user_dir, {f"{args.against} (before)": args.against.resolve(), "this tree": here}, args)
        return
    if args.dashboard:
        server, url = start_server(llm_bin, env, user_dir)
        try:
            dashboard_cost(url, [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.clients)], args.tokens,
                           args.rounds)
        finally:
            server.terminate()
            server.wait(30)
        return

    startup = []  # the floor under both: starting an llm process at all
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([str(llm_bin), "--version"], env=env, check=True, capture_output=True)
        startup.append(time.perf_counter() - start)
    in_process = [one_shot(llm_bin, env, user_dir, p, args.tokens, ["-o", "server", "off"]) for p in prompts]
    server, url = start_server(llm_bin, env, user_dir)
    try:
        routed = [one_shot(llm_bin, env, user_dir, p, args.tokens, []) for p in prompts]
        assert all(r["served_by"] == url for r in routed)
        clients = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.clients)]
        throughput(url, clients[:1], args.tokens, at_once=False)  # warm-up
        rounds = []  # the two modes alternate, so a load change on the machine hits both
        for _ in range(args.rounds):
            rounds.append((throughput(url, clients, args.tokens, at_once=False),
                           throughput(url, clients, args.tokens, at_once=True)))
    finally:
        server.terminate()
        server.wait(30)

    print(f"\n{'one-shot llm calls':<20} {'calls':>5} {'TTFT median s':>13} {'engine TTFT s':>13} "
          f"{'wall median s':>13} {'MB read/call':>12}")
    for name, rows in (("in-process", in_process), ("routed to server", routed)):
        print(f"{name:<20} {len(rows):>5} {statistics.median(r['ttft'] for r in rows):>13.3f} "
              f"{statistics.median(r['engine_ttft'] for r in rows):>13.3f} "
              f"{statistics.median(r['wall'] for r in rows):>13.3f} {statistics.median(r['mb'] for r in rows):>12.1f}")
    ratio = statistics.median(r["ttft"] for r in routed) / statistics.median(r["ttft"] for r in in_process)
    print(f"routed TTFT / in-process TTFT: {ratio:.2f}x; `llm --version` alone takes "
          f"{statistics.median(startup):.3f} s (median of 3)")

    print(f"\n{'clients (median of ' + str(args.rounds) + ')':<22} {'requests':>8} {'tokens':>6} {'wall s':>7} "
          f"{'tokens/s':>8} {'vs one':>6}")
    base = None
    for i, name in enumerate(("one after another", f"{args.clients} at once")):
        tokens = statistics.median(r[i][0] for r in rounds)
        wall = statistics.median(r[i][1] for r in rounds)
        base = base or tokens / wall
        print(f"{name:<22} {args.clients:>8} {tokens:>6.0f} {wall:>7.2f} {tokens / wall:>8.2f} {tokens / wall / base:>5.2f}x")


if __name__ == "__main__":
    main()
