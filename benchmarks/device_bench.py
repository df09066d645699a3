"""The GPU run of issue 35 in one script: every figure beside stock mlx-lm's, in one run.

On engine_bench's checkpoint (qwen3_moe shape, 4-bit, 128 experts, top-8, 4 MoE layers),
built by the factory where it runs, so its files sit in the page cache that serves the
engine's reads:

- decode: stock mlx-lm with every weight loaded, the engine at 100%, 50% and 25% of each
  layer's experts resident, and whether each run's greedy tokens equal stock's;
- syncs: one host read-back of router ids alone (its round trip), and what one costs
  inside decode (the 100% pool, which reads nothing back, against the same pool with an
  observer that makes every MoE layer call read its ids back); syncs per token at 25%;
- speculation at 25%: ngram at k 0 / 3 / auto on spec_bench's repetitive and ordinary
  prompts, and its oracle drafter (always right) at k 3, the bound for landing drafts;
- overlap auto / on / off at 25%, each run from an empty pool;
- cold prompts of 4k and 16k tokens at 25% against stock, in mlx-lm's 2048-token calls and
  in one expert chunk, with their passes over the experts;
- continuous batching at 25% through the server (batch_bench), B = 1, 2, 4, 8.

Prints one table, then the issue's targets as measured. Each row is also a JSON line in
OUT/bench.jsonl (OUT: --out, else $OUT, else a new temporary folder).

    python benchmarks/device_bench.py [--tokens 64] [--runs 3] [--rounds 2] [--prefill 4000,16000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch_bench import batch_medians, serving  # noqa: E402
from engine_bench import CACHE, SHAPE, engine_decode, stock_decode  # noqa: E402
from spec_bench import decode as spec_decode  # noqa: E402
from spec_bench import prompts as spec_prompts  # noqa: E402

from fixtures.factory import build_checkpoint  # noqa: E402
from fixtures.scripted import ScriptedDrafter  # noqa: E402
from llm_mlx_streaming import syncs  # noqa: E402
from llm_mlx_streaming.engine.manager import EngineManager  # noqa: E402
from llm_mlx_streaming.engine.request import Request  # noqa: E402

APPLE_SYNC_MS = 2.0  # one router read-back per MoE layer, measured on Apple GPUs


class Table:
    """Rows printed as they come (a run cut short still shows what it measured) and
    kept for the targets and the JSON lines."""

    def __init__(self, out: Path):
        self.rows, self.log = [], (out / "bench.jsonl").open("w")
        print(f"{'section':<11} {'figure':<34} {'value':>9} {'unit':<9} {'ratio':>7} {'against':<13} notes",
              flush=True)

    def add(self, section, figure, value, unit, ratio=None, against="", notes="", **figures) -> dict:
        """One row; `figures` (numbers the targets read) go to the JSON line only."""
        row = dict(section=section, figure=figure, value=value, unit=unit, ratio=ratio, against=against,
                   notes=notes, **figures)
        self.rows.append(row)
        self.log.write(json.dumps(row) + "\n")
        self.log.flush()
        ratio_s = "-" if ratio is None else f"{ratio:.2f}x"
        print(f"{section:<11} {figure:<34} {value:>9.2f} {unit:<9} {ratio_s:>7} {against:<13} {notes}", flush=True)
        return row


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def same(runs: list[dict], reference: list[int]) -> bool:
    return all(r["tokens"] == reference for r in runs)


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def decode_rows(table, engine, path, args, prompt) -> dict:
    """Stock, then the engine at each resident share; returns stock's run."""
    E = SHAPE["num_experts"]
    stock_decode(path, prompt, 8)  # warm-up: compiles kernels
    stock = [stock_decode(path, prompt, args.tokens) for _ in range(args.runs)]
    stock_tps = median_of(stock, "tps")
    table.add("decode", "stock mlx-lm, all resident", stock_tps, "tok/s", 1.0, "stock",
              f"peak {max(r['peak'] for r in stock) / 1e6:.0f} MB")
    for fraction in (1.0, 0.5, 0.25):
        engine.load(path, expert_slots=max(1, round(E * fraction)))
        engine_decode(engine, prompt, 8)  # warm-up: fills the pool, compiles kernels
        runs = [engine_decode(engine, prompt, args.tokens) for _ in range(args.runs)]
        tps, exact = median_of(runs, "tps"), same(runs, stock[0]["tokens"])
        table.add("decode", f"streaming {fraction:.0%} resident", tps, "tok/s", tps / stock_tps, "stock",
                  f"tokens = stock: {yes(exact)}; hit {median_of(runs, 'hit_rate'):.3f}; "
                  f"{median_of(runs, 'mb_per_token'):.2f} MB/tok; {median_of(runs, 'syncs_per_token'):.2f} syncs/tok",
                  exact=exact)
    return stock[0] | {"tps": stock_tps}


def round_trip_ms(reps: int = 200) -> float:
    """Median milliseconds of one read-back alone: a router's top-k for one token,
    evaluated and copied to the host as a MoE layer call does it (syncs.to_host)."""
    D, E, k = SHAPE["hidden_size"], SHAPE["num_experts"], SHAPE["top_k"]
    h, w = mx.random.normal((1, D)), mx.random.normal((E, D))
    mx.eval(h, w)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        syncs.to_host(mx.argpartition(-(h @ w.T), k - 1, axis=-1)[..., :k])
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:]) * 1e3


def sync_rows(table, engine, path, prompt, args) -> None:
    """The read-back's cost alone, and inside decode: the whole pool, which reads nothing
    back, with and without an observer that makes every MoE layer call read its ids back
    (and uses nothing), the two taking turns."""
    table.add("syncs", "router read-back alone", round_trip_ms(), "ms/sync", None, "",
              f"median of 190; Apple GPUs: {APPLE_SYNC_MS:.0f} ms per layer")
    engine.load(path, expert_slots=SHAPE["num_experts"])
    engine_decode(engine, prompt, 8)  # warm-up: fills the pool
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for forced in (False, True) * args.runs:
        for module in engine.loaded.layers:
            module.observer = (lambda layer, needed, single: None) if forced else None
        runs[forced].append(engine_decode(engine, prompt, args.tokens))
    for module in engine.loaded.layers:
        module.observer = None
    plain, forced = runs[False], runs[True]
    added = median_of(forced, "syncs_per_token") - median_of(plain, "syncs_per_token")
    seconds = 1 / median_of(forced, "tps") - 1 / median_of(plain, "tps")
    table.add("syncs", "read-back inside decode (100%)", seconds / added * 1e3 if added else float("nan"),
              "ms/sync", None, "", f"{added:.2f} syncs/tok added cost {seconds * 1e3:.2f} ms/tok")


def speculation_rows(table, engine, path, args) -> None:
    E = SHAPE["num_experts"]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    texts = spec_prompts(vocab)
    engine.load(path, expert_slots=E // 4)
    spec_decode(engine, texts["ordinary"], 8, 0)  # warm-up
    for name in ("repetitive", "ordinary"):
        plain = spec_decode(engine, texts[name], args.tokens, 0)
        cases = [("ngram", k, None) for k in (0, 3, "auto")]
        if name == "ordinary":
            cases.append(("oracle", 3, ScriptedDrafter(texts[name] + plain["tokens"], vocab)))
        for drafter, k, scripted in cases:
            row = plain if k == 0 else spec_decode(engine, texts[name], args.tokens, k, scripted)
            accept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
            per_pass = "-" if row["tokens_per_pass"] is None else f"{row['tokens_per_pass']:.2f}"
            exact = row["tokens"] == plain["tokens"]
            table.add("spec 25%", f"{drafter} {name} k={k}", row["tps"], "tok/s", row["tps"] / plain["tps"], "k=0",
                      f"tokens = k0: {yes(exact)}; accept {accept}; {per_pass} tok/pass; "
                      f"{row['mb_per_token']:.2f} MB/tok", exact=exact)


def empty_pool(engine, slots: int) -> None:
    """The pools rebuilt empty, so the next run reads its misses (from the page cache)."""
    engine.configure(expert_slots=slots + 1)
    engine.configure(expert_slots=slots)


def overlap_rows(table, engine, path, args, prompt, stock) -> None:
    """Each run from an empty pool: a pool warm with this prompt's experts reads nothing."""
    slots = SHAPE["num_experts"] // 4
    engine.load(path, expert_slots=slots)
    by_mode: dict[str, list[dict]] = {}
    for mode in ("auto", "on", "off") * args.runs:  # the modes take turns
        engine.configure(overlap=mode)
        empty_pool(engine, slots)
        by_mode.setdefault(mode, []).append(engine_decode(engine, prompt, args.tokens))
    for mode, runs in by_mode.items():
        tps, exact = median_of(runs, "tps"), same(runs, stock["tokens"])
        table.add("overlap", f"overlap {mode}, 25% resident", tps, "tok/s", tps / stock["tps"], "stock",
                  f"tokens = stock: {yes(exact)}; {median_of(runs, 'mb_per_token'):.2f} MB/tok", exact=exact)
    engine.configure(overlap="auto")


def prefill_rows(table, engine, path, args) -> None:
    """Cold prompts at 25% resident: stock mlx-lm's prefill against the engine's, in
    mlx-lm's 2048-token calls and in one expert chunk (engine/prefill.py), each with its
    passes over the experts; tokens per second of prompt, best of 2 from an empty pool."""
    from llm_mlx_streaming.engine.planner import prefill_step_for

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    slots = SHAPE["num_experts"] // 4
    for n in args.prefill:
        prompt = [int(t) for t in np.random.default_rng(3).integers(3, vocab - 40, n)]
        stock = max(stock_decode(path, prompt, 1)["prefill_tps"] for _ in range(2))  # the first compiles
        table.add("prefill", f"stock mlx-lm, {n} tokens", stock, "tok/s", 1.0, "stock")
        engine.load(path, expert_slots=slots)
        chunk = prefill_step_for(path, "16GB", max_context=n + 8)
        for label, step in (("2048-token calls", 2048), ("expert chunk", chunk)):
            runs = []
            for _ in range(2):
                empty_pool(engine, slots)
                engine.prompts.reset()
                list(engine.run(None, Request(prompt=prompt, max_tokens=1, prefill_step=step, max_context=n + 8)))
                runs.append(engine.last_stats)
            best = max(runs, key=lambda s: s["prefill_tps"])
            table.add("prefill", f"streaming 25%, {n} tokens, {label}", best["prefill_tps"], "tok/s",
                      best["prefill_tps"] / stock, "stock",
                      f"{best['expert_passes']} passes over the experts in {best['prefill_calls']} calls, "
                      f"{best['prefill_mb_read']:.0f} MB read, TTFT {best['ttft_seconds']:.2f} s")


def batch_rows(table, path, args, stock) -> None:
    kinds = [(b, {}) for b in (1, 2, 4, 8)]
    with serving(path, SHAPE["num_experts"] // 4, 8) as url:
        rows = batch_medians(url, kinds, args.tokens, args.rounds)
    base = rows[0]
    for row, (b, _) in zip(rows, kinds):
        table.add("batch 25%", f"B={b} aggregate", row["aggregate"], "tok/s", row["aggregate"] / base["aggregate"],
                  "B=1", f"{row['syncs_per_token']:.2f} syncs/tok ({row['syncs_per_token'] / base['syncs_per_token']:.2f}x "
                  f"B=1); {row['aggregate'] / stock['tps']:.2f}x stock; largest batch {row['largest']:.0f}; "
                  f"{row['mb_per_token']:.2f} MB/tok", syncs_per_token=row["syncs_per_token"])


def targets(rows: list[dict]) -> None:
    """The issue's targets, each a ratio of this run."""
    by = {r["figure"]: r for r in rows}
    syncs_at = lambda b: by[f"B={b} aggregate"]["syncs_per_token"]  # noqa: E731
    checks = [
        ("tokens equal stock (and k=0's) in every row", all(r.get("exact", True) for r in rows)),
        (f"spec k=3 repetitive >= 1.5x k=0 ({by['ngram repetitive k=3']['ratio']:.2f}x)",
         by["ngram repetitive k=3"]["ratio"] >= 1.5),
        (f"spec k=auto ordinary >= 0.95x k=0 ({by['ngram ordinary k=auto']['ratio']:.2f}x)",
         by["ngram ordinary k=auto"]["ratio"] >= 0.95),
        (f"batch B=4 >= 2.0x B=1 ({by['B=4 aggregate']['ratio']:.2f}x)", by["B=4 aggregate"]["ratio"] >= 2.0),
        (f"syncs/tok B=4 <= 0.3x B=1 ({syncs_at(4) / syncs_at(1):.2f}x)", syncs_at(4) <= 0.3 * syncs_at(1)),
        (f"decode 25% >= 0.5x stock ({by['streaming 25% resident']['ratio']:.2f}x)",
         by["streaming 25% resident"]["ratio"] >= 0.5),
    ]
    print("\ntargets")
    for text, met in checks:
        print(f"  {'met   ' if met else 'MISSED'} {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per decode run and per batched request")
    parser.add_argument("--runs", type=int, default=3, help="runs per decode row (median)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over B = 1, 2, 4, 8 (median)")
    parser.add_argument("--prefill", type=lambda v: [int(n) for n in v.split(",")], default=[4000, 16000],
                        help="prompt tokens of the prefill rows, comma-separated")
    parser.add_argument("--out", type=Path, help="folder for bench.jsonl (default: $OUT, else a temporary one)")
    args = parser.parse_args()
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="device-bench-"))
    out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    path = build_checkpoint(CACHE / "qwen3_moe-bench", "qwen3_moe", quant="4bit", seed=0, **SHAPE)
    print(f"mlx {mx.__version__} on {mx.default_device()}; checkpoint {path} ready in {time.perf_counter() - start:.0f}s; "
          f"{args.tokens} tokens, medians of {args.runs} runs; rows in {out / 'bench.jsonl'}", flush=True)
    table = Table(out)
    prompt = list(range(3, 35))
    engine = EngineManager()
    stock = decode_rows(table, engine, path, args, prompt)
    sync_rows(table, engine, path, prompt, args)
    speculation_rows(table, engine, path, args)
    overlap_rows(table, engine, path, args, prompt, stock)
    prefill_rows(table, engine, path, args)
    engine.unload()
    batch_rows(table, path, args, stock)
    targets(table.rows)
    print(f"\n{time.perf_counter() - start:.0f}s in all")


if __name__ == "__main__":
    main()
