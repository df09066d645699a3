"""The contract across architectures: every supported mlx-lm MoE module x pool sizes x
features, each compared to stock mlx-lm, printed as a table with the total wall time.

    python benchmarks/contract_cross.py [ARCH ...]

A cell is ok when the engine's greedy tokens and logprobs equal stock mlx-lm's for
every pool size (all experts, top-k, 2 slots); n/a when stock mlx-lm itself cannot run
the feature on the tiny model (a quantized cache needs head dims its group size divides).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from llm_mlx_streaming.checkpoints.factory import build_checkpoint
from llm_mlx_streaming.checkpoints.support import UNSUPPORTED, moe_modules
from llm_mlx_streaming.engine.loading import load_streaming
from llm_mlx_streaming.engine.prefill import tile_attention

EXPERTS, TOP_K = 8, 2
POOLS = (None, TOP_K, 2)
FEATURES = {  # name: (prompt length, prefill step, generate_step keyword arguments, tile)
    "plain": (24, 2048, {}, None),
    "kv_bits 4": (40, 2048, {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}, None),
    "tiled long prompt": (80, 64, {}, 16),
}


def run(model, prompt, step, kwargs, n=8):
    out = list(generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=step, **kwargs))
    return [t for t, _ in out], [np.array(l) for _, l in out]


def cell(path, vocab, stock, feature) -> str:
    length, step, kwargs, tile = FEATURES[feature]
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, vocab, length)]
    try:
        expected = run(stock, prompt, step, kwargs)
    except (ValueError, RuntimeError):
        return "n/a"
    for slots in POOLS:
        loaded = load_streaming(path, expert_slots=slots)
        try:
            if tile:
                tile_attention(loaded.model, tile)
            got = run(loaded.model, prompt, step, kwargs)
        except Exception as e:  # a failure of the engine, shown in the table
            return f"FAIL ({type(e).__name__})"
        finally:
            loaded.store.close()
        if got[0] != expected[0] or not all(np.array_equal(a, b) for a, b in zip(got[1], expected[1])):
            return f"FAIL (pool {slots or 'all'})"
    return "ok"


def main(archs) -> None:
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for arch in archs:
            path = build_checkpoint(Path(root) / arch, arch, num_experts=EXPERTS, top_k=TOP_K)
            stock, config = load_model(path)
            rows.append([arch] + [cell(path, config["vocab_size"], stock, f) for f in FEATURES])
    head = ["architecture"] + list(FEATURES)
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{len(rows)} architectures x pools all/top-k/2 x {len(FEATURES)} features: "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:] or [m for m in moe_modules() if m not in UNSUPPORTED])
