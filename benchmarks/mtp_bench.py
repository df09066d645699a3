"""What an MTP head's drafts cost next to the target's own decode step.

Builds (once, then reuses) a 4-bit qwen3_next or deepseek_v3 checkpoint with an MTP
head, then, at several pool sizes (the head's pool sized like the layers'), times:
one plain decode step of the target (k = 0), and the drafter's work per verify pass:
`accept` of the pass's tokens (one head pass over them) plus `propose(k)` (k - 1 more
chained head steps). Reads are counted per pool, so the head's MB per pass are its own.
Random heads never agree with their target, so acceptance is not measured here (see
spec_bench's oracle rows for what verification saves); this measures the price side.

    python benchmarks/mtp_bench.py [--arch qwen3_next] [--steps 32] [--k 1,2,3,4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.factory import build_checkpoint  # noqa: E402
from llm_mlx_streaming.engine.loading import load_streaming  # noqa: E402
from llm_mlx_streaming.speculation.drafter import DraftContext  # noqa: E402
from llm_mlx_streaming.speculation.kinds import make_drafter  # noqa: E402
from llm_mlx_streaming.speculation.mtp_head import loaded_head  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
SHAPE = dict(hidden_size=512, moe_intermediate_size=512, num_experts=64, top_k=8, num_layers=4)


def target_steps(loaded, prompt, steps):
    """Median seconds of one greedy single-token step, and MB read per step."""
    model, cache = loaded.model, make_prompt_cache(loaded.model)
    hidden = model.model(mx.array([prompt]), cache=cache)
    token = mx.argmax(model.lm_head(hidden[:, -1]), axis=-1)
    mx.eval(token)
    times, before = [], sum(p.counters.bytes_read for p in loaded.pools)
    history = []
    for _ in range(steps):
        tic = time.perf_counter()
        hidden = model.model(token[None], cache=cache)
        token = mx.argmax(model.lm_head(hidden[:, -1]), axis=-1)
        mx.eval(token, hidden)
        times.append(time.perf_counter() - tic)
        history.append((int(token.item()), hidden[0]))
    read = sum(p.counters.bytes_read for p in loaded.pools) - before
    return statistics.median(times), read / 1e6 / steps, history


def draft_passes(drafter, head_pool, prompt, history, k):
    """Median seconds of accept(one token) + propose(k), and the head's MB per pass."""
    drafter.reset(prompt)
    times, before = [], head_pool.counters.bytes_read
    for token, hidden in history:
        tic = time.perf_counter()
        drafter.accept([token], hidden)
        drafter.propose(k)
        times.append(time.perf_counter() - tic)
    read = head_pool.counters.bytes_read - before
    return statistics.median(times), read / 1e6 / len(history)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_next", choices=("qwen3_next", "deepseek_v3"))
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per row")
    parser.add_argument("--k", default="1,2,3,4", help="draft depths to time")
    parser.add_argument("--fractions", default="1.0,0.25")
    args = parser.parse_args()
    depths = [int(k) for k in args.k.split(",")]

    start = time.perf_counter()
    path = build_checkpoint(CACHE / f"{args.arch}-mtp-bench", args.arch, quant="4bit", mtp=True,
                            **SHAPE)
    print(f"checkpoint {path} (ready in {time.perf_counter() - start:.1f}s)")
    prompt = list(range(3, 35))
    E = SHAPE["num_experts"]

    print(f"\n{'resident':>8} {'target ms/step':>14} {'MB/step':>8} "
          + " ".join(f"{f'k={k} ms':>8} {'x step':>6} {'head MB':>7}" for k in depths))
    for fraction in (float(f) for f in args.fractions.split(",")):
        slots = max(1, round(E * fraction))
        loaded = load_streaming(path, expert_slots=slots)
        try:
            context = DraftContext(model=loaded.model, tokenizer=loaded.tokenizer, loaded=loaded)
            drafter = make_drafter("mtp", context)
            drafter.gate = 0.0  # a random head is never confident: time the whole chain
            target_steps(loaded, prompt, 4)  # warm-up
            step, step_mb, history = target_steps(loaded, prompt, args.steps)
            cells = []
            for k in depths:
                draft_passes(drafter, loaded_head(loaded).pool, prompt, history[:4], k)  # warm-up
                seconds, mb = draft_passes(drafter, loaded_head(loaded).pool, prompt, history, k)
                cells.append(f"{seconds * 1e3:>8.2f} {seconds / step:>6.2f} {mb:>7.2f}")
            print(f"{fraction:>8.0%} {step * 1e3:>14.2f} {step_mb:>8.2f} " + " ".join(cells))
        finally:
            loaded.store.close()


if __name__ == "__main__":
    main()
