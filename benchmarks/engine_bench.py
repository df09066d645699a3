"""Decode speed of the streaming engine against stock mlx-lm, at several pool sizes.

Builds (once, then reuses) a synthetic qwen3_moe checkpoint with at least 500 MB of
4-bit experts, then prints one table: stock mlx-lm with every weight loaded, and the
streaming engine with 100%, 50%, 25% and 10% of each layer's experts resident.

    python benchmarks/engine_bench.py [--tokens 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.factory import build_checkpoint  # noqa: E402
from llm_mlx_streaming.engine.manager import EngineManager  # noqa: E402
from llm_mlx_streaming.engine.request import Request  # noqa: E402
from llm_mlx_streaming.experts.index import CheckpointIndex  # noqa: E402
from llm_mlx_streaming.experts.policies import DEFAULT_POLICY  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
SHAPE = dict(hidden_size=1024, moe_intermediate_size=768, num_experts=128, top_k=8, num_layers=4)


def stock_decode(path: Path, prompt: list[int], tokens: int) -> dict:
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(path))
    mx.reset_peak_memory()
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=tokens))
    result = {"tps": out[-1].generation_tps, "prefill_tps": out[-1].prompt_tps, "peak": mx.get_peak_memory(),
              "tokens": [r.token for r in out]}
    del model
    mx.clear_cache()
    return result


def engine_decode(engine: EngineManager, prompt: list[int], tokens: int) -> dict:
    engine.prompts.reset()
    mx.reset_peak_memory()
    first, out = None, []
    for response in engine.run(None, Request(prompt=list(prompt), max_tokens=tokens)):
        if first is None:
            first = engine.counters()  # prefill done: what follows is decode
        out.append(response.token)
    end = engine.counters()
    stats = engine.last_stats
    decode_tokens = stats["generated_tokens"] - 1
    lookups = (end.hits - first.hits) + (end.misses - first.misses)
    return {
        "tps": stats["decode_tps"],
        "peak": mx.get_peak_memory(),
        "hit_rate": (end.hits - first.hits) / lookups if lookups else None,
        "mb_per_token": (end.bytes_read - first.bytes_read) / 1e6 / max(decode_tokens, 1),
        "tokens": out,
        "unplaced": stats["unplaced"],
        "syncs_per_token": stats["syncs_per_token"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens to decode per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per row (median reported)")
    parser.add_argument("--fractions", default="1.0,0.5,0.25,0.1")
    args = parser.parse_args()

    start = time.perf_counter()
    path = build_checkpoint(CACHE / "qwen3_moe-bench", "qwen3_moe", quant="4bit", seed=0, **SHAPE)
    index = CheckpointIndex(path)
    expert_mb = sum(e.nbytes for k, e in index.tensors.items() if "switch_mlp" in k) / 1e6
    print(f"checkpoint {path} ({expert_mb:.0f} MB of experts, ready in {time.perf_counter() - start:.1f}s)")
    print(f"policy {DEFAULT_POLICY}; experts read from {'the packed store' if (path / 'mlxs-packed').exists() else 'the safetensors'}")
    prompt = list(range(3, 35))
    E = SHAPE["num_experts"]

    rows = []
    stock = [stock_decode(path, prompt, args.tokens) for _ in range(args.runs)]
    stock_tps = statistics.median(r["tps"] for r in stock)
    rows.append(("stock mlx-lm", E, stock_tps, 1.0, None, 0.0, max(r["peak"] for r in stock)))

    engine = EngineManager()
    for fraction in (float(f) for f in args.fractions.split(",")):
        slots = max(1, round(E * fraction))
        engine.load(path, expert_slots=slots)  # the default policy
        engine_decode(engine, prompt, 8)  # warm-up: fills the pool, compiles kernels
        runs = [engine_decode(engine, prompt, args.tokens) for _ in range(args.runs)]
        assert all(r["unplaced"] == 0 for r in runs)
        tps = statistics.median(r["tps"] for r in runs)
        rows.append((f"streaming {fraction:.0%}", slots, tps, tps / stock_tps,
                     statistics.median(r["hit_rate"] for r in runs),
                     statistics.median(r["mb_per_token"] for r in runs),
                     max(r["peak"] for r in runs)))
    engine.unload()

    print(f"\n{'engine':<16} {'slots':>5} {'decode tok/s':>12} {'vs stock':>8} "
          f"{'hit rate':>8} {'MB read/tok':>11} {'peak MB':>8}")
    for name, slots, tps, ratio, hit, mb, peak in rows:
        hit_s = "-" if hit is None else f"{hit:.3f}"
        print(f"{name:<16} {slots:>5} {tps:>12.2f} {ratio:>7.2f}x {hit_s:>8} {mb:>11.2f} {peak / 1e6:>8.0f}")


if __name__ == "__main__":
    main()
