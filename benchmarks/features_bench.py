"""What the llm features of #11 cost and save, on a synthetic checkpoint.

1. `--schema`: the constrained-decoding processor's time per token (llguidance's mask
   plus applying it), and decode tok/s with and without a schema.
2. The conversation cache on disk: a second turn in a "new process" (the in-process
   KV cache dropped) with the saved cache loaded, against prefilling it again.
3. What the conversation cache writes per response over a conversation of several
   turns, each in a new process (`llm -c`): the segment the turn added, against
   rewriting the whole cache after every response (what it did before #18).

    python benchmarks/features_bench.py [--prompt-tokens 1500] [--runs 3] [--turns 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.factory import build_checkpoint  # noqa: E402
from llm_mlx_streaming.engine.disk_cache import DiskCache, DiskCacheSpec  # noqa: E402
from llm_mlx_streaming.engine.manager import EngineManager  # noqa: E402
from llm_mlx_streaming.engine.request import LoadSpec, Request, Sampling  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
SHAPE = dict(hidden_size=512, moe_intermediate_size=256, num_experts=32, top_k=4, num_layers=8, quant="4bit")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "age", "tags", "address"],
}


def run(engine, load, request):
    generation = engine.run(load, request)
    for _ in generation:
        pass
    return generation


def schema_rows(engine, load, tokenizer, tokens: int, runs: int) -> list[tuple]:
    from llm_mlx_streaming.prompt.constrained import SchemaProcessor, schema_grammar

    grammar = schema_grammar(SCHEMA)
    prompt = tokenizer.encode("Describe a person as JSON.")
    rows = []
    for label in ("no schema", "schema"):
        tps, per_token, first = [], [], []
        for _ in range(runs):
            engine.prompts.reset()
            processors = []
            if label == "schema":
                processor = SchemaProcessor(grammar, tokenizer)
                timed = _Timed(processor)
                processors = [timed]
            stats = run(engine, load, Request(prompt=prompt, max_tokens=tokens, sampling=Sampling(temperature=1.0, seed=1),
                                              logits_processors=processors, budget_aware=processors)).stats
            tps.append(stats["decode_tps"])
            if label == "schema":
                per_token.append(statistics.median(timed.times) * 1e6)
                first.append(timed.first * 1e3)
        rows.append((label, statistics.median(tps), statistics.median(per_token) if per_token else None,
                     statistics.median(first) if first else None))
    return rows


def processor_alone(tokenizer, tokens: int, n_vocab: int) -> tuple[float, float]:
    """(median, mean) microseconds per call of the schema processor driven on its own,
    on random logits with greedy picks: the mask's cost without the model's."""
    import mlx.core as mx
    import numpy as np

    from llm_mlx_streaming.prompt.constrained import SchemaProcessor, schema_grammar

    processor = SchemaProcessor(schema_grammar(SCHEMA), tokenizer)
    processor.limit_tokens(tokens)
    rng = np.random.default_rng(0)
    history, times = [0], []
    for _ in range(tokens):
        logits = mx.array(rng.standard_normal((1, n_vocab)).astype(np.float32))
        start = time.perf_counter()
        out = processor(mx.array(history), logits)
        mx.eval(out)
        times.append(time.perf_counter() - start)
        history.append(int(mx.argmax(out[0]).item()))
        if history[-1] == tokenizer.eos_token_id:
            break
    return statistics.median(times[1:]) * 1e6, statistics.mean(times[1:]) * 1e6


class _Timed:
    """Wall time of a logits processor's calls after the first (the mask is computed on
    the host); the first call, which builds llguidance's tokenizer view and the
    matcher, is kept apart in `first`."""

    def __init__(self, inner):
        self.inner, self.times, self.first = inner, [], None

    def limit_tokens(self, budget):
        self.inner.limit_tokens(budget)

    def __call__(self, tokens, logits):
        import mlx.core as mx

        mx.eval(tokens, logits)  # the model's step is not the processor's time
        start = time.perf_counter()
        out = self.inner(tokens, logits)
        mx.eval(out)
        if self.first is None:
            self.first = time.perf_counter() - start
        else:
            self.times.append(time.perf_counter() - start)
        return out


def restart_rows(engine, load, tokenizer, prompt_tokens: int, runs: int) -> list[tuple]:
    words = ("the quick brown fox jumps over the lazy dog and " * (prompt_tokens // 8 + 1)).split()
    first = tokenizer.encode(" ".join(words[: prompt_tokens]))[:prompt_tokens]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        spec = DiskCacheSpec(Path(tmp), 10**10)
        for label, disk in (("prefill again", None), ("disk cache", spec)):
            seconds, reused = [], 0
            for _ in range(runs):
                engine.prompts.reset()
                done = run(engine, load, Request(prompt=first, max_tokens=8, conversation_cache=spec))
                second = first + done.tokens + tokenizer.encode(" and then what happened next?")
                engine.prompts.reset()  # a new process: nothing in memory
                start = time.perf_counter()
                stats = run(engine, load, Request(prompt=second, max_tokens=8, conversation_cache=disk)).stats
                seconds.append(time.perf_counter() - start)
                reused = stats["reused_tokens"]
            rows.append((label, len(second), reused, statistics.median(seconds)))
    return rows


def write_rows(engine, load, tokenizer, prompt_tokens: int, turns: int, tokens: int) -> list[tuple]:
    """(turn, tokens cached after it, tokens it took from disk, bytes its segment took,
    bytes a whole rewrite takes) for each turn of a conversation, each turn in a new
    process: the whole rewrite is the same cache saved with nothing kept from before."""
    words = ("the quick brown fox jumps over the lazy dog and " * (prompt_tokens // 8 + 1)).split()
    prompt = tokenizer.encode(" ".join(words[: prompt_tokens]))[:prompt_tokens]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        spec = DiskCacheSpec(Path(tmp) / "segments", 10**11)
        whole = DiskCache(DiskCacheSpec(Path(tmp) / "whole", 10**11), "whole")
        for turn in range(1, turns + 1):
            engine.prompts.reset()  # a new process: nothing in memory
            done = run(engine, load, Request(prompt=prompt, max_tokens=tokens, conversation_cache=spec))
            stats = done.stats
            held, cache = engine.prompts.conversations()[-1]
            rewrite = whole.save(cache, held, kept=0)
            rows.append((turn, len(held), stats["disk_cache_tokens"],
                         stats["disk_cache_saved_bytes"], rewrite))
            prompt = prompt + done.tokens + tokenizer.encode(" and then what happened next?")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    path = build_checkpoint(CACHE / "features-q4", "qwen3_moe", **SHAPE)
    engine = EngineManager()
    load = LoadSpec(path=path, expert_slots=SHAPE["num_experts"] // 2)
    engine.load(path, expert_slots=load.expert_slots)
    tokenizer = engine.tokenizer
    print(f"checkpoint {path.name}: {SHAPE}, {load.expert_slots} slots per layer, CPU")
    print()
    print(f"{'decode':<12} {'tok/s':>8} {'mask us/token':>14} {'first call ms':>14}  (mask: median per call after the first)")
    for label, tps, us, first in schema_rows(engine, load, tokenizer, args.tokens, args.runs):
        print(f"{label:<12} {tps:>8.1f} {('%.0f' % us) if us is not None else '-':>14} "
              f"{('%.1f' % first) if first is not None else '-':>14}")
    median, mean = processor_alone(tokenizer, args.tokens, engine.config["vocab_size"])
    print(f"processor alone (random logits): median {median:.0f} us, mean {mean:.0f} us per token")
    print()
    print(f"{'second turn':<14} {'prompt':>7} {'reused':>7} {'seconds':>8}")
    for label, prompt, reused, seconds in restart_rows(engine, load, tokenizer, args.prompt_tokens, args.runs):
        print(f"{label:<14} {prompt:>7} {reused:>7} {seconds:>8.3f}")
    print(f"(median of {args.runs}; second turn: prompt {args.prompt_tokens} tokens + 8 generated + a new message)")
    print()
    print(f"{'turn':>4} {'cached':>7} {'from disk':>9} {'MB written':>11} {'MB whole rewrite':>17}")
    rows = write_rows(engine, load, tokenizer, args.prompt_tokens, args.turns, args.tokens)
    for turn, cached, loaded, written, rewrite in rows:
        print(f"{turn:>4} {cached:>7} {loaded:>9} {written / 1e6:>11.2f} {rewrite / 1e6:>17.2f}")
    print(f"{'all':>4} {'':>7} {'':>9} {sum(r[3] for r in rows) / 1e6:>11.2f} {sum(r[4] for r in rows) / 1e6:>17.2f}"
          f"  (turns of {args.tokens} generated tokens + a new message, each in a new process)")


if __name__ == "__main__":
    main()
