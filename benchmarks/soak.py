"""A server that runs for days: thousands of mixed requests against `llm mlxs serve` on
the bundled demo, with the server's memory, files and threads sampled as they go.

The server runs in its own process (`llm mlxs serve --port 0`, a fresh llm user dir,
127.0.0.1) and is stopped at the end. Requests go in windows of 100, each from a
number of clients at once (4 to 16 by default, changing from window to window) over
every API (benchmarks/soak_requests.py), streamed and whole, a share hung up
mid-stream, a share with a tool or a JSON schema, prompts from a few words to near the
context. After each window, once the server is idle, one row: its RSS, MLX active and
cache memory, the caches it keeps, open files and threads. A fixed greedy request is
asked first and every 500 requests, and must get the same text each time.

`--faults disconnects` adds clients that hang up before the headers and during a long
prefill; `--faults disk` shrinks the conversation cache's quota at 40% of the run,
makes its folder unwritable at 60% and puts both back at 80%. Afterwards every request
must still be answered, and nothing may stay behind.

`--models 2` serves a second model beside the demo (a copy of its checkpoint, so the
same prompts fit it; max_models 2) and sends each request to either; `--keep-alive 2s`
gives that keep_alive to a share of the requests (`--keep-alive-share`, 0.5), as Ollama's
clients send it. Each row then counts the models loaded since the start, and the report
checks that no model was loaded again beyond what the keep_alives asked for: a model
goes only after a reply with a keep_alive ended and no request for it came within it.

    python benchmarks/soak.py [--requests 5000] [--clients 4-16] [--faults disconnects,disk] [--seed 0] [--tree DIR]
                              [--models 2] [--keep-alive 2s] [--keep-alive-share 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soak_requests import APIS, BUSY, CANCELLED, OK, Case, send, words  # noqa: E402

from llm_mlx_streaming.sizes import parse_size  # noqa: E402
from llm_mlx_streaming.values import duration_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 100  # requests between samples
CHECK_EVERY = 500  # requests between two asks of the fixed greedy request
CHECK = Case("openai_chat", "Explain what a list is", 12)
QUOTA = "256KB"  # the conversation cache's size while `--faults disk` shrinks it
FAULTS = {"disconnects", "disk"}
IDLE_THREADS_SECONDS = 12  # anyio ends a worker thread idle for 10 s
LONG, MEDIUM = 0.005, 0.1  # shares of prompts near the context and of 30-100 words (the rest: 3-15)
SECOND = "mlx-stream/second"  # the second model of `--models 2`
MARGIN = 0.3  # seconds a client's view of a gap between requests may exceed the server's


class ServerProcess:
    """`llm mlxs serve --port 0 -m mlx-stream` in a fresh llm user dir, stopped on exit."""

    def __init__(self, user_dir: Path, tree: Path, timeout: float = 300.0, args=("-m", "mlx-stream"),
                 models: int = 1) -> None:
        self.user_dir = user_dir
        if models == 2:  # the demo's checkpoint copied: a second model the same prompts fit
            second = user_dir / "second-model"
            shutil.copytree(tree / "llm_mlx_streaming" / "checkpoints" / "demo", second)
            (user_dir / "mlx-streaming.json").write_text(json.dumps(
                {"max_models": 2, "models": {"second": {"path": str(second)}}}))
        env = {**os.environ, "LLM_USER_PATH": str(user_dir), "PYTHONPATH": str(tree)}
        llm = Path(sys.executable).with_name("llm")
        self.proc = subprocess.Popen([str(llm), "mlxs", "serve", "--port", "0", *args], env=env,
                                     stdout=subprocess.DEVNULL, stderr=open(user_dir / "server.log", "wb"))
        found = user_dir / "mlx-streaming" / "server.json"
        deadline = time.monotonic() + timeout
        while not found.exists() or not found.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the server did not start:\n{self.log()}")
            time.sleep(0.1)
        info = json.loads(found.read_text())
        self.host, self.port, self.pid = info["host"], info["port"], info["pid"]
        while self.stats().get("state") != "loaded":
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the model did not load:\n{self.log()}")
            time.sleep(0.2)

    def get(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://{self.host}:{self.port}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict:
        try:
            return self.get("/api/stats")
        except OSError:
            return {}

    def idle(self, timeout: float = 120.0) -> bool:
        """Wait until nothing runs or waits (cancelled generations included) and the
        engine has given its freed memory back."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.stats()
            server = s.get("server", {})
            engine_idle = s.get("engine_idle", not (s.get("requests_queued") or s.get("batch")))  # older trees
            if engine_idle and not (server.get("running") or server.get("queued")):
                return True
            time.sleep(0.1)
        return False

    def log(self) -> str:
        return (self.user_dir / "server.log").read_text(errors="replace")[-3000:]

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


def proc_figures(pid: int) -> dict:
    """RSS, open files and threads of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"rss_mb": rss_kb / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


def sample(server: ServerProcess, done: int, errors: int, started: float, note: str) -> dict:
    """One row: the server's process figures, MLX's memory and the caches it keeps."""
    stats = server.stats()
    caches = stats.get("caches", {})
    disk = caches.get("conversation_cache") or {}
    mb = lambda key: None if stats.get(key) is None else stats[key] / 2**20  # noqa: E731
    return {"requests": done, "seconds": time.monotonic() - started, **proc_figures(server.pid),
            "mlx_active_mb": mb("mlx_active_memory_bytes"), "mlx_cache_mb": mb("mlx_cache_memory_bytes"),
            "replies": caches.get("reply_memory", {}).get("entries"),
            "disk_mb": None if disk.get("bytes") is None else disk["bytes"] / 2**20,
            "conversations": disk.get("entries"), "errors": errors, "note": note,
            "loaded": len(stats.get("models") or ()), "loads": stats.get("model_loads"),
            "pools": stats.get("server", {}).get("threads", {})}


def plan(rng: random.Random, n: int, faults: set, long_words: int, models: int = 1,
         keep_alive: str | None = None, keep_share: float = 0.0) -> list[Case]:
    """`n` cases: the greedy check first and every CHECK_EVERY, the mix in between (each to
    either model, a share with `keep_alive`)."""
    cases = []
    for i in range(n):
        if i % CHECK_EVERY == 0:
            cases.append(CHECK)
            continue
        api = rng.choice(list(APIS))
        draw = rng.random()
        size = long_words if draw < LONG else rng.randint(30, 100) if draw < LONG + MEDIUM else rng.randint(3, 15)
        prompt = words(rng, size)
        stream = rng.random() < 0.5
        extra = rng.random()
        kind = {}
        if extra < 0.1 and APIS[api].tools:
            kind = {"tools": True}
        elif extra < 0.2 and APIS[api].schema:
            kind = {"schema": True}
        cut = rng.random()
        if stream and cut < 1 / 3:
            kind.update(cut="mid_stream", cut_after=rng.randint(0, 6))
        elif "disconnects" in faults and cut > 0.95:
            kind.update(cut="before_headers")
        elif "disconnects" in faults and cut > 0.94:
            prompt = words(rng, long_words)  # hung up while its long prefill runs
            kind.update(cut="prefill", cut_after=rng.uniform(0.05, 0.5))
        if models == 2 and rng.random() < 0.5:
            kind.update(model=SECOND)
        if keep_alive is not None and rng.random() < keep_share:
            kind.update(keep_alive=keep_alive)
        cases.append(Case(api, prompt, rng.randint(3, 8), stream=stream, **kind))
    return cases


def long_prompt_words(server: ServerProcess, context: int, margin: float = 0.9) -> int:
    """Words whose prompt comes near `context` tokens (`margin` of it, as counted)."""
    rng, n = random.Random(1), 100
    for _ in range(8):
        tokens = server.get("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": words(rng, n)}]})
        n = max(1, int(n * context * margin / tokens["input_tokens"]))
    return int(n * 0.97)  # room for the words' spread


def context_of(server: ServerProcess) -> int:
    info = server.get("/api/show", {"model": "mlx-stream"})
    model = next((v for k, v in info["model_info"].items() if k.endswith(".context_length")), None)
    setting = server.get("/api/engine/config").get("max_context")  # a number, or "auto": the model's, planned
    return min(v for v in (model, setting) if isinstance(v, int))


class Disk:
    """The conversation cache's faults: a small quota, an unwritable folder, both undone."""

    def __init__(self, user_dir: Path) -> None:
        self.settings = user_dir / "mlx-streaming.json"
        self.folder = user_dir / "mlx-streaming" / "kv-cache"

    def quota(self) -> str:
        self._set(conversation_cache_size=QUOTA)
        return f"conversation_cache_size {QUOTA}"

    def _set(self, **values) -> None:
        """The settings file with `values` (None: unset), its other settings kept (`--models 2`'s)."""
        settings = json.loads(self.settings.read_text()) if self.settings.exists() else {}
        settings = {k: v for k, v in {**settings, **values}.items() if v is not None}
        self.settings.write_text(json.dumps(settings))

    def unwritable(self) -> str:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.write_text("")  # a file where the folder was: every write fails, even as root
        return "cache folder unwritable"

    def restore(self) -> str:
        self.folder.unlink(missing_ok=True)
        self._set(conversation_cache_size=None)
        return "quota and folder back"

    def quota_applies(self) -> bool:
        applies = self.settings.exists() and "conversation_cache_size" in json.loads(self.settings.read_text())
        return applies and self.folder.is_dir()

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.folder.rglob("*") if p.is_file()) if self.folder.is_dir() else 0


def run_window(server: ServerProcess, cases: list[Case], clients: int, timeout: float, deadline: float,
               outcomes: Counter, checks: list[str], tools: bool, spans: list) -> None:
    """`cases` from `clients` threads at once; each thread takes the next until none is left;
    `spans` gets each request's (model, start, end, keep_alive) as the client saw it."""
    pending = iter(cases)
    lock = threading.Lock()

    def client() -> None:
        for _ in range(len(cases)):
            with lock:
                case = next(pending, None)
            if case is None or time.monotonic() > deadline:
                return
            start = time.monotonic()
            outcome, text = send(server.host, server.port, case, timeout)
            with lock:
                spans.append((case.model, start, time.monotonic(), case.keep_alive))
            if case.tools and not tools and outcome.startswith("400"):
                outcome = "400 tools refused (no tool support in the template)"
            with lock:
                outcomes[outcome] += 1
                if case is CHECK:
                    checks.append(text if outcome == OK else f"<{outcome}>")

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + timeout)


def is_error(outcome: str) -> bool:
    return outcome not in (OK, CANCELLED, BUSY) and not outcome.startswith("400 tools refused")


COLUMNS = (  # heading, key, format
    ("requests", "requests", "{:d}"), ("s", "seconds", "{:.0f}"), ("RSS MB", "rss_mb", "{:.1f}"),
    ("MLX active MB", "mlx_active_mb", "{:.1f}"), ("MLX cache MB", "mlx_cache_mb", "{:.1f}"),
    ("replies", "replies", "{:d}"), ("disk MB", "disk_mb", "{:.1f}"), ("conversations", "conversations", "{:d}"),
    ("fds", "fds", "{:d}"), ("threads", "threads", "{:d}"), ("loaded", "loaded", "{:d}"), ("loads", "loads", "{:d}"),
    ("errors", "errors", "{:d}"),
)


def table(rows: list[dict]) -> str:
    widths = [max(len(head), 6) for head, _, _ in COLUMNS]
    lines = ["  ".join(head.rjust(w) for (head, _, _), w in zip(COLUMNS, widths))]
    for row in rows:
        cells = ["-" if row.get(key) is None else fmt.format(row[key]) for _, key, fmt in COLUMNS]
        lines.append("  ".join(c.rjust(w) for c, w in zip(cells, widths)) + "  " + row["note"])
    return "\n".join(lines)


def clients_for(window: int, low: int, high: int) -> int:
    counts = list(range(low, high + 1, 4)) or [low]
    return counts[window % len(counts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--clients", default="4-16", help="MIN-MAX clients at once (each window takes the next count)")
    ap.add_argument("--faults", default="", help="comma-separated: disconnects, disk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    ap.add_argument("--max-minutes", type=float, default=60.0, help="the whole run stops sending after this")
    ap.add_argument("--tree", type=Path, default=ROOT,
                    help="serve the package in this tree (e.g. an earlier commit's, to compare)")
    ap.add_argument("--models", type=int, choices=(1, 2), default=1, help="2: a second model beside the demo")
    ap.add_argument("--keep-alive", help="a keep_alive (e.g. 2s) that a share of the requests send")
    ap.add_argument("--keep-alive-share", type=float, default=0.5)
    args = ap.parse_args()
    low, _, high = args.clients.partition("-")
    low, high = int(low), int(high or low)
    faults = {f for f in args.faults.split(",") if f}
    if faults - FAULTS:
        raise SystemExit(f"unknown faults: {', '.join(sorted(faults - FAULTS))} (known: {', '.join(sorted(FAULTS))})")

    user_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    server = ServerProcess(user_dir, args.tree.resolve(), models=args.models)
    outcomes, checks, rows, quota_kept, spans = Counter(), [], [], True, []
    try:
        tools = "tools" in server.get("/api/show", {"model": "mlx-stream"}).get("capabilities", [])
        context = context_of(server)
        long_words = long_prompt_words(server, context)
        print(f"server pid {server.pid} on {server.host}:{server.port}; context {context} tokens, long prompts "
              f"{long_words} words; faults: {', '.join(sorted(faults)) or 'none'}", flush=True)
        cases = plan(random.Random(args.seed), args.requests, faults, long_words, args.models, args.keep_alive,
                     args.keep_alive_share)
        disk = Disk(user_dir)
        steps = {}
        if "disk" in faults:  # at the window that holds each share of the run
            steps = {int(args.requests * share) // WINDOW * WINDOW: step
                     for share, step in ((0.4, disk.quota), (0.6, disk.unwritable), (0.8, disk.restore))}
        started = time.monotonic()
        deadline = started + args.max_minutes * 60
        errors = lambda: sum(n for o, n in outcomes.items() if is_error(o))  # noqa: E731
        rows.append(sample(server, 0, 0, started, "idle, loaded"))
        for w, first in enumerate(range(0, len(cases), WINDOW)):
            if time.monotonic() > deadline:
                rows[-1]["note"] += f"; stopped: --max-minutes {args.max_minutes:g} passed"
                break
            step = steps[first]() if first in steps else ""
            clients = clients_for(w, low, high)
            window = cases[first:first + WINDOW]
            run_window(server, window, clients, args.timeout, deadline, outcomes, checks, tools, spans)
            idle = server.idle()
            if disk.quota_applies():
                quota_kept &= disk.used() <= parse_size(QUOTA)
            note = ", ".join(x for x in (f"{clients} clients", step, "" if idle else "NOT IDLE") if x)
            rows.append(sample(server, first + len(window), errors(), started, note))
            print(table(rows).splitlines()[-1], flush=True)
        time.sleep(IDLE_THREADS_SECONDS)
        rows.append(sample(server, rows[-1]["requests"], errors(), started,
                           f"idle, {IDLE_THREADS_SECONDS:g} s later"))
    finally:
        server.stop()
        shutil.rmtree(user_dir, ignore_errors=True)
    failed = report(rows, outcomes, checks, quota_kept if "disk" in faults else None)
    if args.keep_alive is not None or args.models == 2:
        failed |= loads_report(rows, spans, args.models)
    sys.exit(1 if failed else 0)


def asked_unloads(spans: list) -> int:
    """How many unloads the keep_alives asked for: for each model, each gap with no request
    for it in flight that lasted at least the keep_alive of the latest request before it
    (as Ollama counts it; less MARGIN: the server sees a request shorter than its client does)."""
    count = 0
    for model in {s[0] for s in spans}:
        mine = sorted((s for s in spans if s[0] == model), key=lambda s: s[1])
        last_end, last_keep = None, None
        for _, start, end, keep in mine:
            if last_end is not None and start > last_end and last_keep is not None:
                count += start - last_end >= duration_seconds(last_keep) - MARGIN
            last_end, last_keep = max(end, last_end or end), keep
    return count


def loads_report(rows: list[dict], spans: list, models: int) -> bool:
    """Loads beyond each model's first against the unloads the keep_alives asked for; True
    when there were more."""
    again = (rows[-1]["loads"] or 0) - (rows[0]["loads"] or 0) - (models - 1)  # the second model's first load
    asked = asked_unloads(spans)
    print(f"models loaded again: {again}; unloads the keep_alives asked for (a gap of at least the keep_alive "
          f"after a reply that sent one): at most {asked}: {'ok' if again <= asked else 'MORE THAN ASKED'}")
    return again > asked


def report(rows: list[dict], outcomes: Counter, checks: list[str], quota_kept) -> bool:
    """The table, the outcomes and the targets; True when an error or a wrong reply came."""
    print()
    print(table(rows))
    print()
    print("outcomes:", ", ".join(f"{o}: {n}" for o, n in outcomes.most_common()))
    errors = {o: n for o, n in outcomes.items() if is_error(o)}
    print("errors by kind:", ", ".join(f"{o}: {n}" for o, n in errors.items()) or "none")
    wrong = [c for c in checks if c != checks[0]]
    print(f"greedy check: asked {len(checks)} times, {len(wrong)} wrong replies; the reply: {checks[0]!r}"
          if checks else "greedy check: never asked")
    if quota_kept is not None:
        print(f"conversation cache within its {QUOTA} quota while it applied: {'yes' if quota_kept else 'NO'}")
    warm = next((r for r in rows if r["requests"] >= CHECK_EVERY), rows[min(1, len(rows) - 1)])
    start, end = rows[0], rows[-1]
    growth = (end["rss_mb"] / warm["rss_mb"] - 1) * 100
    print(f"RSS {warm['rss_mb']:.1f} MB after {warm['requests']} requests (the warm-up), {end['rss_mb']:.1f} MB at "
          f"the end: {growth:+.1f}% (target within 10%)")
    print(f"MLX active memory idle: {start['mlx_active_mb']:.1f} MB loaded, {end['mlx_active_mb']:.1f} MB at the end "
          "(the difference: the last conversation's KV cache, kept for its next turn)")
    print(f"open files {warm['fds']} -> {end['fds']}, threads {warm['threads']} -> {end['threads']} "
          f"(after the warm-up -> at the end)")
    pools = sorted(set(warm["pools"]) | set(end["pools"]))
    print("Python threads by pool (/api/stats), after the warm-up -> at the end:",
          ", ".join(f"{p} {warm['pools'].get(p, 0)} -> {end['pools'].get(p, 0)}" for p in pools))
    return bool(errors or wrong)


if __name__ == "__main__":
    main()
