"""What the llm features of #11 cost and save, on a synthetic checkpoint.

1. `--schema`: the constrained-decoding processor's time per token (llguidance's mask
   plus applying it), and decode tok/s with and without a schema.
2. The conversation cache on disk: a second turn in a "new process" (the in-process
   KV cache dropped) with the saved cache loaded, against prefilling it again.
3. What the conversation cache writes per response over a conversation of several
   turns, each in a new process (`llm -c`): the segment the turn added, against
   rewriting the whole cache after every response (what it did before #18).
4. A thinking budget (`thinking_budget`, Claude Code's `budget_tokens`): decode tok/s
   of a long reasoning with the cap on and off, on a smaller checkpoint that decodes
   fast enough to reach a 16k budget (`--cap-budget`); the cap closes the reasoning at
   the budget and the reply ends 64 tokens later.

    python benchmarks/features_bench.py [--prompt-tokens 1500] [--runs 3] [--turns 5] [--only cap]
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
CAP_SHAPE = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2, num_layers=2,
                 max_position_embeddings=32768)
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


def cap_rows(budget: int, runs: int) -> list[tuple]:
    """(label, decode tok/s, decode tok/s per CPU second, the cap's microseconds per token,
    tokens, host syncs) of a reasoning opened by the prompt and decoded past `budget`,
    with the cap and without, the two alternating. End-of-text is kept out of both (a
    random model would end early), so each reply is `budget` + 64 tokens. The CPU
    figure (this process's user + system time) and the cap's own time hold where the
    machine is shared; wall-clock tok/s does not."""
    import resource

    from llm_mlx_streaming import syncs
    from llm_mlx_streaming.processors import Stateless, reasoning_cap

    path = build_checkpoint(CACHE / "features-cap", "qwen3_moe", **CAP_SHAPE)
    engine = EngineManager()
    load = LoadSpec(path=path, expert_slots=CAP_SHAPE["num_experts"])
    engine.load(path, expert_slots=load.expert_slots)
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode("Think this through at length.")
    eos = sorted(tokenizer.eos_token_ids)
    end = tokenizer.encode(" done", add_special_tokens=False)  # the think block's end tag, as ids

    def no_end(tokens, logits):
        return logits.at[:, eos].add(-float("inf"))

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    figures = {"cap off": [], "cap on": []}
    for i in range(runs):  # the two alternate, so that the machine's other load falls on both
        for label in sorted(figures, reverse=i % 2 == 1):
            engine.session.reset()
            cap = _Clocked(reasoning_cap(len(prompt), True, [], end, [], budget))
            processors = [Stateless(no_end), *([cap] if label == "cap on" else [])]
            before, used = syncs.count(), cpu()
            done = run(engine, load, Request(prompt=prompt, max_tokens=budget + 64, logits_processors=processors,
                                             sampling=Sampling(temperature=1.0, seed=1)))
            used = cpu() - used
            n = len(done.tokens)
            figures[label].append((done.stats["decode_tps"], n / used, cap.seconds / n * 1e6, n,
                                   syncs.count() - before))
    return [(label, *(statistics.median(column) for column in zip(*rows))) for label, rows in figures.items()]


class _Clocked:
    """A logits processor's own host time, summed over its calls (nothing is evaluated
    for it: what it costs the step is what it does on the host)."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __call__(self, tokens, logits):
        start = time.perf_counter()
        out = self.inner(tokens, logits)
        self.seconds += time.perf_counter() - start
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
    parser.add_argument("--cap-budget", type=int, default=16384)
    parser.add_argument("--only", choices=["cap"], help="print only this table")
    args = parser.parse_args()
    if args.only != "cap":
        feature_tables(args)
        print()
    print(f"{'thinking budget ' + str(args.cap_budget):<22} {'tok/s':>7} {'tok/CPU s':>10} {'cap us/token':>13} "
          f"{'tokens':>7} {'host syncs':>11}")
    rows = cap_rows(args.cap_budget, args.runs)
    for label, tps, per_cpu, us, tokens, counted in rows:
        print(f"{label:<22} {tps:>7.1f} {per_cpu:>10.1f} {f'{us:.1f}' if label == 'cap on' else '-':>13} "
              f"{tokens:>7.0f} {counted:>11.0f}")
    print(f"cap on / cap off: {rows[1][1] / rows[0][1]:.3f} tok/s, {rows[1][2] / rows[0][2]:.3f} per CPU second "
          f"(medians of {args.runs}, alternating; {CAP_SHAPE}, every expert resident)")


def feature_tables(args) -> None:
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
