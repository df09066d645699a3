"""What grows per request, found inside the server: the soak's requests against a
server run in this process (on a thread, as the tests run it), with tracemalloc and
the garbage collector's census compared between the end of a warm-up and the end.

    python benchmarks/soak_growth.py [--warmup 200] [--requests 600] [--clients 8] [--top 25]

Prints the allocation sites that grew most (with a few frames of where they came
from), the object types whose count grew, and MLX's active and cache memory.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soak import context_of, long_prompt_words, plan, proc_figures  # noqa: E402
from soak_requests import send  # noqa: E402


class InProcess:
    """The server on a thread of this process, as `ServerProcess` offers it to `long_prompt_words`."""

    def __init__(self, server) -> None:
        self.server = server
        self.host, self.port = "127.0.0.1", server.port

    def get(self, path: str, body=None) -> dict:
        import json
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server.url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            return json.loads(resp.read())


def census() -> Counter:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def drive(server: InProcess, cases, clients: int) -> Counter:
    pending, lock, outcomes = iter(cases), threading.Lock(), Counter()

    def client():
        for _ in range(len(cases)):
            with lock:
                case = next(pending, None)
            if case is None:
                return
            outcome, _ = send(server.host, server.port, case, 120)
            with lock:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def quiet(timeout: float = 120) -> None:
    """Until the engine has nothing to run and has given its freed memory back."""
    from llm_mlx_streaming.engine.worker import idle

    deadline = time.monotonic() + timeout
    while not idle() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--faults", default="")
    args = ap.parse_args()
    os.environ["LLM_USER_PATH"] = tempfile.mkdtemp(prefix="soak-growth-")

    import mlx.core as mx

    from llm_mlx_streaming.engine.manager import get_manager
    from llm_mlx_streaming.server.process.run import Server

    server = InProcess(Server(port=0, model="mlx-stream").start())
    engine = get_manager()
    while engine.state != "loaded":
        time.sleep(0.1)
    cases = plan(random.Random(0), args.warmup + args.requests, set(filter(None, args.faults.split(","))),
                 long_prompt_words(server, context_of(server)))
    print("warm-up:", dict(drive(server, cases[:args.warmup], args.clients)), flush=True)
    quiet()
    tracemalloc.start(8)
    before, counted, threads = tracemalloc.take_snapshot(), census(), thread_kinds()
    mlx_before, rss_before = (mx.get_active_memory(), mx.get_cache_memory()), proc_figures(os.getpid())["rss_mb"]
    started = time.monotonic()
    print("measured:", dict(drive(server, cases[args.warmup:], args.clients)),
          f"in {time.monotonic() - started:.0f} s", flush=True)
    quiet()
    after, counted_after, threads_after = tracemalloc.take_snapshot(), census(), thread_kinds()
    mlx_after, rss_after = (mx.get_active_memory(), mx.get_cache_memory()), proc_figures(os.getpid())["rss_mb"]
    server.server.stop()

    n = args.requests
    diffs = [d for d in after.compare_to(before, "traceback") if d.size_diff > 0]
    total = sum(d.size_diff for d in after.compare_to(before, "filename"))
    print(f"\npython heap grew {total / 1e6:+.2f} MB over {n} requests ({total / n:+.0f} B/request)")
    for d in diffs[:args.top]:
        print(f"\n{d.size_diff / 1e3:+9.1f} kB {d.count_diff:+6d} blocks")
        for frame in d.traceback.format(most_recent_first=True)[:8]:
            print("   ", frame)
    print("\nobject types that grew:")
    grew = sorted(((k, counted_after[k] - counted[k]) for k in counted_after), key=lambda kv: -kv[1])
    for name, grown in grew[:args.top]:
        if grown > 0:
            print(f"  {grown:+7d} {name} ({counted_after[name]})")
    print("\nthreads by kind, after the warm-up -> at the end:",
          ", ".join(f"{k} {threads[k]} -> {threads_after[k]}" for k in sorted(threads | threads_after)))
    print(f"\nMLX active {mlx_before[0] / 2**20:.1f} -> {mlx_after[0] / 2**20:.1f} MiB, "
          f"cache {mlx_before[1] / 2**20:.1f} -> {mlx_after[1] / 2**20:.1f} MiB; "
          f"RSS {rss_before:.1f} -> {rss_after:.1f} MiB (this process: the clients too, and tracemalloc's own)")


def thread_kinds() -> Counter:
    """This process's threads by name, numbers dropped (`asyncio_3` -> `asyncio_`): the
    pools they belong to."""
    return Counter(re.sub(r"\d+", "", t.name) for t in threading.enumerate())


if __name__ == "__main__":
    main()
