"""Continuous batching through `llm mlxs serve`: B concurrent requests decoded together.

On engine_bench's checkpoint (qwen3_moe shape, 4-bit, 128 experts, top-8, 4 layers,
25% of each layer's experts resident) a server runs in this process with max_batch 8.
For B = 1, 2, 4, 8 it sends B requests that arrive together (queued while the engine
thread is held, then let go at once; 64 tokens each, prompts never seen before, so
no KV is reused) and prints aggregate
and per-request tokens/s, MB read and host syncs per generated token, distinct experts
per MoE layer call, and the modeled GPU rate: tokens / (measured time + syncs x 2 ms),
the round trip an Apple GPU pays for each host synchronisation (a router read-back)
that this CPU does not. Then, with B-1 requests decoding, one more arrives: its time to
first token. A last row runs B = 4 with `max_batch 1` (one at a time, as before).
`--speculation` instead prints syncs per token for k 0, 3 and auto on the trained demo
model's own text.

    python benchmarks/batch_bench.py [--tokens 64] [--batches 1,2,4,8] [--rounds 2]
    python benchmarks/batch_bench.py --speculation [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_bench import CACHE, SHAPE  # noqa: E402  (the same checkpoint)
from serve_bench import PROMPTS  # noqa: E402

from fixtures.factory import build_checkpoint  # noqa: E402

ROUND_TRIP_S = 0.002  # one host synchronisation on an Apple GPU (a MoE layer's router read-back)


def ask(url: str, prompt: str, tokens: int, out: dict, **extra) -> None:
    """One streamed chat request; records its time to first token, end and figures."""
    body = {"model": "mlx-stream", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as resp:
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "ttft" not in out and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                out["ttft"] = time.perf_counter() - start
            if chunk.get("mlx_stream", {}).get("stats"):
                out["stats"] = chunk["mlx_stream"]["stats"]
    out["wall"] = time.perf_counter() - start


def live(url: str) -> dict:
    with urllib.request.urlopen(url + "/api/stats", timeout=60) as resp:
        return json.loads(resp.read())


def fresh(i: int, count=[0]) -> str:  # noqa: B006 - prompts never seen before: no KV reuse
    count[0] += 1
    return f"{PROMPTS[i % len(PROMPTS)]} ({count[0]})"


def batch_round(url: str, b: int, tokens: int, **extra) -> dict:
    """B requests arriving together (queued behind a job holding the engine thread, then
    released at once): aggregate figures from the engine's counters."""
    from llm_mlx_streaming.engine import worker

    before = live(url)
    outs = [{} for _ in range(b)]
    threads = [threading.Thread(target=ask, args=(url, fresh(i), tokens, outs[i]), kwargs=extra)
               for i in range(b)]
    go = threading.Event()
    worker.submit(lambda out: go.wait(600))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while live(url)["requests_queued"] < b:
        assert time.monotonic() < deadline, "the requests did not queue"
        time.sleep(0.01)
    start = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = live(url)
    delta = lambda key: after[key] - before[key]  # noqa: E731
    generated = delta("generated_tokens")
    calls = delta("calls_no_load") + delta("calls_loaded")
    return {
        "b": b, "wall": wall, "tokens": generated,
        "aggregate": generated / wall,
        "per_request": statistics.mean(o["stats"]["decode_tps"] for o in outs),
        "mb_per_token": delta("bytes_read") / 1e6 / generated,
        "experts_per_call": (delta("hits") + delta("misses")) / calls if calls else 0.0,
        "syncs_per_token": delta("syncs") / generated,
        "modeled": generated / (wall + delta("syncs") * ROUND_TRIP_S),
        "largest": max(o["stats"].get("batch", 1) for o in outs),
        "unplaced": delta("unplaced"),
    }


def late_arrival(url: str, b: int, tokens: int) -> float:
    """Time to first token of a request sent while B-1 others decode."""
    outs = [{} for _ in range(b)]
    threads = [threading.Thread(target=ask, args=(url, fresh(i), tokens, outs[i])) for i in range(b - 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while b > 1 and not all("ttft" in o for o in outs[: b - 1]):  # every early one is decoding
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ask(url, fresh(b), tokens, outs[-1])
    for t in threads:
        t.join()
    return outs[-1]["ttft"]


@contextmanager
def serving(path: Path, slots: int, max_batch: int):
    """The URL of a server in this process serving `path` with `slots` experts per layer
    resident (its own llm user dir), the model loaded and the pools filled."""
    from llm_mlx_streaming.server.process.run import Server

    user_dir = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    os.environ["LLM_USER_PATH"] = str(user_dir)
    (user_dir / "mlx-streaming.json").write_text(json.dumps({
        "default_model": "bench", "max_batch": max_batch, "conversation_cache": False,
        "models": {"bench": {"path": str(path), "expert_slots": slots}}}))
    with Server(port=0, max_queue=16) as server:
        ask(server.url, fresh(0), 8, {})  # warm-up: loads the model (not behind a held engine), fills the pools
        yield server.url


def batch_medians(url: str, kinds: list[tuple[int, dict]], tokens: int, rounds: int) -> list[dict]:
    """batch_round's figures for each (B, extra request fields), medians over `rounds`;
    the Bs take turns, so a change of the machine's load hits them all."""
    runs: list[list[dict]] = [[] for _ in kinds]
    for _ in range(rounds):
        for i, (b, extra) in enumerate(kinds):
            runs[i].append(batch_round(url, b, tokens, **extra))
    return [{key: statistics.median(r[key] for r in per_kind) for key in per_kind[0]} for per_kind in runs]


def serve_rows(args) -> None:
    slots = SHAPE["num_experts"] // 4
    path = build_checkpoint(CACHE / "qwen3_moe-bench", "qwen3_moe", quant="4bit", seed=0, **SHAPE)
    print(f"checkpoint {path}, {slots} of {SHAPE['num_experts']} experts per layer resident (25%), "
          f"{args.tokens} tokens per request, {ROUND_TRIP_S * 1e3:.0f} ms per sync modeled; medians of {args.rounds} rounds")
    print(f"{'B':<16} {'batch':>5} {'agg tok/s':>9} {'vs B=1':>6} {'req tok/s':>9} {'late TTFT s':>11} "
          f"{'MB/tok':>7} {'experts/call':>12} {'syncs/tok':>9} {'vs B=1':>6} {'GPU tok/s':>9} {'vs B=1':>6}",
          flush=True)
    with serving(path, slots, max(args.batches)) as url:
        kinds = [(b, {}) for b in args.batches] + [(4, {"max_batch": 1})]
        rows = batch_medians(url, kinds, args.tokens, args.rounds)
        base = None
        for row, (b, extra) in zip(rows, kinds):
            ttft = late_arrival(url, b, args.tokens) if not extra else None
            base = base or row
            assert row["unplaced"] == 0
            name = f"{b}" + (" (max_batch 1)" if extra else "")
            ratio = row["aggregate"] / base["aggregate"]
            print(f"{name:<16} {row['largest']:>5.0f} {row['aggregate']:>9.2f} {ratio:>5.2f}x "
                  f"{row['per_request']:>9.2f} {'-' if ttft is None else format(ttft, '.3f'):>11} "
                  f"{row['mb_per_token']:>7.2f} {row['experts_per_call']:>12.1f} {row['syncs_per_token']:>9.2f} "
                  f"{row['syncs_per_token'] / base['syncs_per_token']:>5.2f}x {row['modeled']:>9.2f} "
                  f"{row['modeled'] / base['modeled']:>5.2f}x", flush=True)


def speculation_rows(args) -> None:
    """Syncs per token of plain decoding and of speculation, on the demo model's own text."""
    from llm_mlx_streaming.checkpoints.default import SHIPPED
    from llm_mlx_streaming.engine.manager import EngineManager
    from llm_mlx_streaming.engine.request import Request

    experts = json.loads((SHIPPED / "config.json").read_text())["num_experts"]
    engine = EngineManager()
    print(f"checkpoint {SHIPPED} (trained demo); {args.tokens} tokens; greedy, ngram drafter")
    print(f"{'resident':>8} {'prompt':<28} {'k':>4} {'tok/s':>7} {'syncs/tok':>9} {'GPU tok/s':>9}")
    for slots in (experts, experts // 4):
        engine.load(SHIPPED, expert_slots=slots)
        for text in ("Once upon a time", "The Python standard library"):
            prompt = engine.tokenizer.encode(text)
            for k in (0, 3, "auto"):
                engine.prompts.reset()
                start = time.perf_counter()
                handle = engine.run(None, Request(prompt=prompt, max_tokens=args.tokens, k=k))
                n = len([r for r in handle])
                wall = time.perf_counter() - start
                s = handle.stats
                print(f"{slots / experts:>8.0%} {text:<28} {str(k):>4} {n / wall:>7.2f} "
                      f"{s['syncs_per_token']:>9.2f} {n / (wall + s['syncs'] * ROUND_TRIP_S):>9.2f}", flush=True)
    engine.unload()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every B (medians are printed)")
    parser.add_argument("--speculation", action="store_true", help="only the k 0 / 3 / auto syncs rows")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    speculation_rows(args) if args.speculation else serve_rows(args)


if __name__ == "__main__":
    main()
