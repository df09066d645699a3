"""Long context: KV-cache bytes by kv_bits, and long-prompt prefill by chunk size.

Two tables (docs/benchmarks.md, "Long context"):

1. KV cache at 4k/16k/64k tokens for kv_bits off, 8 and 4, on a 16-bit model: bytes
   the cache holds, its ratio to full precision, the planner's figure, peak memory and
   decode tok/s at that context. The context is filled through the model's own caches
   with random keys and values (what they hold does not change their size or the
   attention cost), then the engine decodes from it.
2. Prefill of 1k/8k/32k-token prompts at 25% of the experts resident: time to first
   token and MB read per prompt token with mlx-lm's 2048-token chunks ("before") and
   with one chunk per prompt, attention in 2048-token tiles ("after"), and for the
   sizes in --untiled the same chunk with attention over it whole ("no tiles").

    python benchmarks/kv_bench.py [--contexts 4096,16384,65536] [--prompts 1024,8192,32768]
    python benchmarks/kv_bench.py --skip-kv      # only the prefill table (and vice versa)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.factory import build_checkpoint  # noqa: E402
from llm_mlx_streaming.engine.kv import KVSpec, cache_bytes, make_cache  # noqa: E402
from llm_mlx_streaming.engine.manager import EngineManager  # noqa: E402
from llm_mlx_streaming.engine.prompt_cache import Lease, Reuse  # noqa: E402
from llm_mlx_streaming.engine.planner import ATTENTION_TILE, plan_memory  # noqa: E402
from llm_mlx_streaming.engine.prefill import tile_mixers  # noqa: E402
from llm_mlx_streaming.engine.request import Request  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
# Attention as a 7-30B MoE has it per KV head (head_dim 64..128), in 16-bit.
KV_SHAPE = dict(hidden_size=512, num_layers=2, num_experts=16, top_k=4, moe_intermediate_size=128,
                head_dim=128, num_attention_heads=8, num_key_value_heads=2, torch_dtype="float16",
                max_position_embeddings=131072)
# Prefill: small enough for a 32k prompt on two CPU cores; 64 experts, top-4.
PREFILL_SHAPE = dict(hidden_size=256, num_layers=2, num_experts=64, top_k=4, moe_intermediate_size=256,
                     head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=131072)
MB = 1e6


def fill(model, cache, context: int, kv: KVSpec, rng) -> None:
    """Put `context` tokens of random keys and values into every attention cache, in
    mlx-lm's 2048-token chunks, quantizing as mlx-lm's generate loop does."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    cfg = model.args
    kv_heads, dim = cfg.num_key_value_heads, cfg.head_dim
    dtype = mx.float16  # the checkpoint's torch_dtype
    done = 0
    while done < context:
        n = min(2048, context - done)
        k = mx.array(rng.standard_normal((1, kv_heads, n, dim)).astype(np.float32)).astype(dtype)
        for c in cache:
            c.update_and_fetch(k, k)
        maybe_quantize_kv_cache(cache, kv.start, kv.group_size, kv.bits)
        mx.eval([c.state for c in cache])
        done += n


def kv_table(contexts: list[int], decode_tokens: int) -> None:
    path = build_checkpoint(CACHE / "kv-bench", "qwen3_moe", quant="4bit", seed=0, **KV_SHAPE)
    engine = EngineManager()
    engine.load(path)  # every expert resident: this table is about attention
    model = engine.loaded.model
    rng = np.random.default_rng(0)
    print(f"\nKV cache ({path.name}: {KV_SHAPE['num_layers']} layers, {KV_SHAPE['num_key_value_heads']} KV heads "
          f"x {KV_SHAPE['head_dim']}, float16)")
    print(f"{'context':>8} {'kv_bits':>7} {'KV bytes':>10} {'x full':>7} {'planned':>10} {'peak MB':>8} {'decode tok/s':>12}")
    for context in contexts:
        full = None
        for bits in (None, 8, 4):
            kv = KVSpec(bits)
            cache = make_cache(model, kv)
            fill(model, cache, context, kv, rng)
            held = cache_bytes(cache)
            full = held if bits is None else full
            planned = plan_memory(path, "64GB", max_context=context, kv=kv).kv_bytes
            engine.prompts.reset()  # the next prompt extends what is cached
            engine.prompts.check_in(Lease(cache, [3] * context, kv, (), 0, Reuse(), context))
            mx.reset_peak_memory()
            list(engine.run(None, Request(prompt=[3] * context + [5, 7], max_tokens=decode_tokens, kv=kv,
                                          max_context=context + decode_tokens + 8)))
            stats = engine.last_stats
            assert stats["reused_tokens"] == context, stats
            print(f"{context:>8} {bits or 'off':>7} {held / MB:>9.1f}M {held / full:>7.3f} {planned / MB:>9.1f}M "
                  f"{stats['peak_memory_bytes'] / MB:>8.0f} {stats['decode_tps']:>12.1f}")
            del cache
            engine.prompts.reset()
            mx.clear_cache()
    engine.unload()


def prefill_table(prompts: list[int], share: float, untiled: set[int], kinds: set[str]) -> None:
    path = build_checkpoint(CACHE / "prefill-bench", "qwen3_moe", quant="4bit", seed=0, **PREFILL_SHAPE)
    E = PREFILL_SHAPE["num_experts"]
    slots = max(PREFILL_SHAPE["top_k"], int(E * share))
    engine = EngineManager()
    engine.load(path, expert_slots=slots)
    vocab = engine.loaded.config["vocab_size"]
    rng = np.random.default_rng(1)
    print(f"\nPrefill at {slots}/{E} experts resident ({path.name}: {PREFILL_SHAPE['num_layers']} MoE layers, "
          f"top-{PREFILL_SHAPE['top_k']}; expert reads from the page cache)")
    print(f"{'prompt':>7} {'chunks':>14} {'TTFT s':>8} {'prefill tok/s':>13} {'MB read':>8} {'MB/prompt tok':>13} {'peak MB':>8}")
    for n in prompts:
        prompt = [int(t) for t in rng.integers(3, vocab, n)]
        rows = [("2048 (before)", 2048, ATTENTION_TILE), (f"{max(n, 2048)} (after)", max(n, 2048), ATTENTION_TILE)]
        if n in untiled:  # the same large chunk with attention over the whole chunk at once
            rows.append((f"{n}, no tiles", n, n))
        rows = [r for r in rows if r[0].split(" ")[-1].strip("(),") in kinds or (", no" in r[0] and "untiled" in kinds)]
        for label, step, tile in rows:
            tile_mixers(engine.loaded.model, tile)
            engine.configure(expert_slots=slots + 1)
            engine.configure(expert_slots=slots)  # every row starts from an empty pool
            engine.prompts.reset()
            mx.clear_cache()
            start = time.perf_counter()
            list(engine.run(None, Request(prompt=prompt, max_tokens=1, prefill_step=step, max_context=n + 8)))
            wall = time.perf_counter() - start
            s = engine.last_stats
            print(f"{n:>7} {label:>14} {s['ttft_seconds']:>8.2f} {n / s['ttft_seconds']:>13.0f} {s['mb_read']:>8.1f} "
                  f"{s['mb_read'] / n:>13.4f} {s['peak_memory_bytes'] / MB:>8.0f}   (wall {wall:.1f}s)")
            sys.stdout.flush()
    engine.unload()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,16384,65536")
    parser.add_argument("--prompts", default="1024,8192,32768")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--resident", type=float, default=0.25, help="share of each layer's experts resident")
    parser.add_argument("--untiled", default="8192",
                        help="prompt sizes that also get a one-chunk row without attention tiles")
    parser.add_argument("--rows", default="before,after,untiled", help="prefill rows to run")
    parser.add_argument("--skip-kv", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    if not args.skip_kv:
        kv_table([int(c) for c in args.contexts.split(",")], args.decode_tokens)
    if not args.skip_prefill:
        prefill_table([int(p) for p in args.prompts.split(",")], args.resident,
                      {int(p) for p in args.untiled.split(",") if p}, set(args.rows.split(",")))


if __name__ == "__main__":
    main()
