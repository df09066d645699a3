"""Speculative decoding on the streamed benchmark checkpoint: what a verify pass costs and saves.

Builds (once, then reuses) engine_bench's checkpoint (qwen3_moe shape, 4-bit, 128
experts, top-8, 4 layers) and, for each resident share and page-cache mode, decodes
greedily with k in {0, 1, 2, 3, 4, 6, auto} and these drafters:

- oracle: replays the k = 0 run's own greedy tokens (always right, costs nothing);
- adversary: proposes a wrong token at every position (the floor);
- ngram on a repetitive prompt (a passage given twice, to quote back) and on ordinary
  (random) text.

Every row checks that its tokens equal the k = 0 run's. Prints one table (decode tok/s,
its ratio to k = 0, MB read per generated token, distinct experts per MoE call of a
verify pass, acceptance, tokens per pass) and, per resident share, the least-squares
split of a pass's time into a fixed part and a part per position, from the oracle rows,
with the forecast for a GPU that adds a fixed host round-trip per MoE layer per pass.

    python benchmarks/spec_bench.py [--tokens 24] [--fractions 0.25,1.0,0.5] \\
        [--page-cache keep,bypass] [--k 0,1,2,3,4,6,auto] [--out results.jsonl]
    python benchmarks/spec_bench.py --breakdown [--reps 8]   # one pass of 1..7 positions
    python benchmarks/spec_bench.py --kernels                # MLX matmuls at 1..8 positions
    python benchmarks/spec_bench.py --depth0 7 --tokens 48   # the loop with no drafts vs plain
    python benchmarks/spec_bench.py --demo --tokens 48       # ngram on the trained demo model's own text
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.factory import build_checkpoint  # noqa: E402
from fixtures.scripted import ScriptedDrafter  # noqa: E402
from llm_mlx_streaming.engine.manager import EngineManager  # noqa: E402
from llm_mlx_streaming.engine.request import Injected, Request  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
SHAPE = dict(hidden_size=1024, moe_intermediate_size=768, num_experts=128, top_k=8, num_layers=4)
GPU_ROUND_TRIP_S = 0.002  # per MoE layer per pass: the router read-back on an Apple GPU


def prompts(vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(1)
    passage = [int(t) for t in rng.integers(3, vocab - 40, 24)]
    return {"ordinary": [int(t) for t in rng.integers(3, vocab - 40, 48)],
            "repetitive": passage + passage}


def decode(engine: EngineManager, prompt: list[int], tokens: int, k, drafter=None) -> dict:
    """One greedy generation from an empty cache; decode-only figures."""
    engine.prompts.reset()
    calls: list[int] = []
    for module in engine.loaded.layers:
        if not module.pool.whole:  # observing a whole pool would add the router read-back it skips
            module.observer = lambda layer, needed, single: calls.append(len(needed))
    first = None
    pass_log: list[tuple[int, float]] = []  # (positions, seconds) of each verify pass

    def timed(inputs, kept, clock=[None]):  # noqa: B006 - the previous pass's end
        now = time.perf_counter()
        if clock[0] is not None:
            pass_log.append((len(inputs), now - clock[0]))
        clock[0] = now

    generation = engine.run(None, Request(prompt=prompt, max_tokens=tokens, k=k,
                                          injected=Injected(drafter=drafter, after_verify=timed)))
    out = []
    for response in generation:
        if first is None:
            first = engine.counters()
            prefill_calls = len(calls)
        out.append(response.token)
    for module in engine.loaded.layers:
        module.observer = None
    stats = generation.stats
    end = engine.counters()
    decoded = stats["generated_tokens"] - 1
    passes = stats["verify_passes"] or decoded
    verify_calls = calls[prefill_calls:]
    return {
        "tokens": out,
        "tps": stats["decode_tps"],
        "seconds": decoded / stats["decode_tps"] if stats["decode_tps"] else None,
        "passes": passes,
        "positions": (stats["draft_tokens"] + passes) if stats["k"] != 0 else decoded,
        "mb_per_token": (end.bytes_read - first.bytes_read) / 1e6 / max(decoded, 1),
        "experts_per_call": float(np.mean(verify_calls)) if verify_calls else None,
        "acceptance": stats["acceptance_rate"],
        "tokens_per_pass": stats["tokens_per_pass"],
        "unplaced": stats["unplaced"],
        "pass_times": pass_log,
    }


def pass_times(engine: EngineManager, prompt: list[int], widths, reps: int) -> list[tuple[int, float]]:
    """(width, fastest seconds) of one forward over `width` positions after `prompt`, the
    cache trimmed back after each; the fastest of `reps` (other processes share this
    machine, and only ever make a pass slower). Positions are random tokens, so each
    pass routes like a verify pass of random drafts."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    model = engine.loaded.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    rng = np.random.default_rng(2)
    out = []
    for width in widths:
        best = float("inf")
        for _ in range(reps):
            tokens = mx.array(rng.integers(3, 400, width))[None]
            tic = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            best = min(best, time.perf_counter() - tic)
            trim_prompt_cache(cache, width)
        out.append((width, best))
    return out


def kernel_rows(reps: int) -> None:
    """How MLX's matmuls here scale with the rows of a pass: the benchmark checkpoint's
    expert shape (4-bit, 1024 -> 768, top-8 of 128), fastest of `reps`."""
    import mlx.core as mx

    def fastest(f):
        best = float("inf")
        for _ in range(reps):
            tic = time.perf_counter()
            mx.eval(f())
            best = min(best, time.perf_counter() - tic)
        return best * 1e3

    D, F, E, top_k = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"], SHAPE["top_k"]
    w, scales, biases = mx.quantize(mx.random.normal((E, F, D)), 64, 4)
    dense = mx.random.normal((F * top_k, D))
    print(f"{'positions':>9} {'experts 4-bit ms':>16} {'dense fp32 ms':>13}  (fastest of {reps}; {mx.default_device()})")
    for rows in (1, 2, 4, 8):
        x = mx.random.normal((1, rows, 1, 1, D))
        idx = mx.random.randint(0, E, (1, rows, top_k)).astype(mx.uint32)
        experts = fastest(lambda: mx.gather_qmm(x, w, scales, biases, rhs_indices=idx, transpose=True,
                                                group_size=64, bits=4))
        flat = mx.random.normal((rows, D))
        print(f"{rows:>9} {experts:>16.2f} {fastest(lambda: flat @ dense.T):>13.2f}")


def depth_zero(engine: EngineManager, prompt: list[int], vocab: int, tokens: int, rounds: int) -> None:
    """Interleaved rounds: plain decoding, the speculative loop with nothing to verify,
    and `k auto` against the adversary; medians of decode tok/s and their ratios."""
    import statistics

    plain_tokens = decode(engine, prompt, tokens, 0)["tokens"]
    runs = {"k 0 (stream_generate)": [], "loop at depth 0": [], "auto vs adversary": []}
    for _ in range(rounds):
        runs["k 0 (stream_generate)"].append(decode(engine, prompt, tokens, 0)["tps"])
        # an oracle for another prompt proposes nothing here: every pass is one position
        idle = ScriptedDrafter([vocab - 1] * (len(prompt) + tokens), vocab)
        runs["loop at depth 0"].append(decode(engine, prompt, tokens, 1, idle)["tps"])
        adversary = ScriptedDrafter(prompt + plain_tokens, vocab, wrong=True)
        runs["auto vs adversary"].append(decode(engine, prompt, tokens, "auto", adversary)["tps"])
    base = statistics.median(runs["k 0 (stream_generate)"])
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"{name:<22} {median:>7.2f} tok/s {median / base:>6.2f}x  "
              f"(rounds: {' '.join(f'{v:.1f}' for v in values)})", flush=True)


DEMO_PROMPTS = ("Once upon a time", "The Python standard library", "A list is")


def demo_rows(engine: EngineManager, args) -> None:
    """ngram on the bundled trained model (docs/demo-model.md), continuing its own kind of
    text. Plain greedy decoding, without the demo's default repetition penalty (speculation
    runs with it too): a small model decoded greedily repeats itself, which is where prompt
    lookup pays (so these rows flatter ngram; say so when quoting)."""
    from llm_mlx_streaming.checkpoints.default import SHIPPED

    experts = json.loads((SHIPPED / "config.json").read_text())["num_experts"]
    ks = [k if k == "auto" else int(k) for k in args.ngram_k.split(",")]
    print(f"checkpoint {SHIPPED} (trained demo); {args.tokens} tokens per run; greedy, no penalty", flush=True)
    print(f"{'resident':>8} {'prompt':<28} {'k':>4} {'tok/s':>7} {'vs k=0':>6} {'MB/tok':>7} "
          f"{'accept':>6} {'tok/pass':>8}", flush=True)
    for fraction in (float(f) for f in args.fractions.split(",")):
        engine.load(SHIPPED, expert_slots=max(1, round(experts * fraction)),
                    page_cache=args.page_cache.split(",")[0])
        encode = engine.tokenizer.encode
        for text in DEMO_PROMPTS:
            prompt = encode(text)
            plain = decode(engine, prompt, args.tokens, 0)
            for k in ks:
                row = plain if k == 0 else decode(engine, prompt, args.tokens, k)
                assert row["tokens"] == plain["tokens"], (text, k, "tokens differ from k=0")
                fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
                print(f"{fraction:>8.0%} {text:<28} {str(k):>4} {row['tps']:>7.2f} "
                      f"{row['tps'] / plain['tps']:>5.2f}x {row['mb_per_token']:>7.2f} "
                      f"{fmt(row['acceptance'], '.2f'):>6} {fmt(row['tokens_per_pass'], '.2f'):>8}", flush=True)
    engine.unload()


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed seconds per pass, seconds per position): least squares over the median
    time of the passes of each width (medians: other processes share this machine)."""
    widths = sorted({p for p, _ in points})
    x = np.array(widths, dtype=float)
    y = np.array([np.median([s for p, s in points if p == w]) for w in widths])
    per_position, fixed = np.polyfit(x, y, 1)
    return float(fixed), float(per_position)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24, help="tokens per generation")
    parser.add_argument("--fractions", default="0.25,1.0,0.5")
    parser.add_argument("--page-cache", default="keep,bypass")
    parser.add_argument("--k", default="0,1,2,3,4,6,auto")
    parser.add_argument("--drafters", default="oracle,adversary,ngram-repetitive,ngram-ordinary")
    parser.add_argument("--ngram-k", default="0,2,4,auto", help="k values for the ngram rows")
    parser.add_argument("--out", type=Path, help="append each row as a JSON line here")
    parser.add_argument("--breakdown", action="store_true",
                        help="only time single forwards of 1..7 positions (fastest of --reps) and split them")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--depth0", type=int, metavar="ROUNDS",
                        help="only compare plain decoding, the loop at depth 0 and auto vs the adversary")
    parser.add_argument("--demo", action="store_true",
                        help="only ngram on the bundled trained demo model's own text (--fractions, --ngram-k)")
    parser.add_argument("--kernels", action="store_true",
                        help="only time MLX's expert and dense matmuls at 1, 2, 4, 8 positions")
    args = parser.parse_args()
    if args.kernels:
        kernel_rows(max(args.reps, 10))
        return
    if args.demo:
        demo_rows(EngineManager(), args)
        return
    ks = [k if k == "auto" else int(k) for k in args.k.split(",")]
    drafters = args.drafters.split(",")

    path = build_checkpoint(CACHE / "qwen3_moe-bench", "qwen3_moe", quant="4bit", seed=0, **SHAPE)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    E, moe_layers = SHAPE["num_experts"], SHAPE["num_layers"]
    texts = prompts(vocab)
    print(f"checkpoint {path}; {args.tokens} tokens per run; greedy", flush=True)
    header = (f"{'resident':>8} {'cache':>6} {'drafter':<16} {'k':>4} {'tok/s':>7} {'vs k=0':>6} "
              f"{'MB/tok':>7} {'experts/call':>12} {'accept':>6} {'tok/pass':>8} {'s/pass':>7}")
    print(header, flush=True)
    engine = EngineManager()
    splits = []
    if args.depth0:
        for fraction in (float(f) for f in args.fractions.split(",")):
            engine.load(path, expert_slots=max(1, round(E * fraction)), page_cache=args.page_cache.split(",")[0])
            print(f"{fraction:.0%} resident, page cache {args.page_cache.split(',')[0]}, {args.tokens} tokens", flush=True)
            depth_zero(engine, texts["ordinary"], vocab, args.tokens, args.depth0)
        engine.unload()
        return
    if args.breakdown:
        print(f"{'resident':>8} {'cache':>6} " + " ".join(f"{'L=' + str(w):>7}" for w in range(1, 8)) + "  (ms, fastest of"
              f" {args.reps})", flush=True)
        for fraction in (float(f) for f in args.fractions.split(",")):
            for page_cache in args.page_cache.split(","):
                engine.load(path, expert_slots=max(1, round(E * fraction)), page_cache=page_cache)
                points = pass_times(engine, texts["ordinary"], range(1, 8), args.reps)
                print(f"{fraction:>8.0%} {page_cache:>6} " + " ".join(f"{t * 1e3:>7.0f}" for _, t in points), flush=True)
                splits.append((fraction, page_cache, *fit(points)))
        engine.unload()
        report_splits(splits, moe_layers)
        return
    for fraction in (float(f) for f in args.fractions.split(",")):
        slots = max(1, round(E * fraction))
        for page_cache in args.page_cache.split(","):
            engine.load(path, expert_slots=slots, page_cache=page_cache)
            for _ in engine.run(None, Request(prompt=texts["ordinary"], max_tokens=8)):
                pass  # warm-up: fills the pool, compiles kernels
            base = {name: decode(engine, text, args.tokens, 0) for name, text in texts.items()}
            oracle_points = []
            for drafter_name in drafters:
                text_name = drafter_name.split("-")[1] if "-" in drafter_name else "ordinary"
                text, plain = texts[text_name], base[text_name]
                row_ks = ks if not drafter_name.startswith("ngram") else [
                    k if k == "auto" else int(k) for k in args.ngram_k.split(",")]
                for k in row_ks:
                    if k == 0:
                        row = plain
                    else:
                        drafter = None
                        if drafter_name in ("oracle", "adversary"):
                            drafter = ScriptedDrafter(text + plain["tokens"], vocab, wrong=drafter_name == "adversary")
                        row = decode(engine, text, args.tokens, k, drafter)
                    assert row["tokens"] == plain["tokens"], (drafter_name, k, "tokens differ from k=0")
                    assert row["unplaced"] == 0
                    per_pass = row["seconds"] / row["passes"] if row["seconds"] else None
                    if drafter_name == "oracle" and k != 0:
                        oracle_points.extend(row["pass_times"])
                    ratio = row["tps"] / plain["tps"] if plain["tps"] else float("nan")
                    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
                    print(f"{fraction:>8.0%} {page_cache:>6} {drafter_name:<16} {str(k):>4} {row['tps']:>7.2f} "
                          f"{ratio:>5.2f}x {row['mb_per_token']:>7.2f} {fmt(row['experts_per_call'], '.1f'):>12} "
                          f"{fmt(row['acceptance'], '.2f'):>6} {fmt(row['tokens_per_pass'], '.2f'):>8} "
                          f"{fmt(per_pass, '.4f'):>7}", flush=True)
                    if args.out:
                        with args.out.open("a") as f:
                            f.write(json.dumps({"fraction": fraction, "page_cache": page_cache,
                                                "drafter": drafter_name, "k": k, "vs_k0": ratio,
                                                **{key: v for key, v in row.items()
                                                   if key not in ("tokens", "pass_times")}}) + "\n")
            if len({p for p, _ in oracle_points}) >= 2:
                fixed, per_position = fit(oracle_points)
                splits.append((fraction, page_cache, fixed, per_position))
    engine.unload()

    report_splits(splits, moe_layers)


def report_splits(splits, moe_layers) -> None:
    if splits:
        print("\nOne verify pass = fixed + per_position x positions (least squares over the pass times per width);")
        print(f"the GPU forecast adds {GPU_ROUND_TRIP_S * 1e3:.0f} ms per MoE layer ({moe_layers} layers) to the fixed part.")
        print(f"{'resident':>8} {'cache':>6} {'fixed ms':>8} {'ms/position':>11} "
              f"{'oracle k=3 bound':>16} {'GPU fixed ms':>12} {'GPU k=3 bound':>13}")
        for fraction, page_cache, fixed, per_position in splits:
            gpu_fixed = fixed + GPU_ROUND_TRIP_S * moe_layers
            bound = lambda a, b, k: (k + 1) * (a + b) / (a + b * (k + 1))  # noqa: E731
            print(f"{fraction:>8.0%} {page_cache:>6} {fixed * 1e3:>8.1f} {per_position * 1e3:>11.1f} "
                  f"{bound(fixed, per_position, 3):>15.2f}x {gpu_fixed * 1e3:>12.1f} "
                  f"{bound(gpu_fixed, per_position, 3):>12.2f}x")


if __name__ == "__main__":
    main()
