"""A cold prompt reads each expert once: an agent's first turn at the speed of one pass.

    python benchmarks/cold_prompt.py [--lengths 2048,12288,30720] [--archs ...] [--iobound MB]
    python benchmarks/cold_prompt.py --plans

Per architecture class (attention qwen3_moe, hybrid linear qwen3_5_moe, sliding window
gpt_oss: tiny random 4-bit checkpoints, hidden 128, 32 experts, top-2, 2 MoE layers, a 32k
context: small enough that a 30k-token prompt prefills in minutes on this CPU),
cold prompts of each length are prefilled at 2 slots per layer and at 25% resident:

- before: the prompt in mlx-lm's 2048-token chunks, each a model call (what `auto` was);
- after: `prefill_step` auto, the planner's expert chunk (engine/planner.py) for a 16 GB
  budget: the whole prompt in one model call, every mixer in 2048-token tiles;

and stock mlx-lm, every expert resident, prefills the same prompt in one run. Each row:
passes over the experts (experts read / (MoE layers x experts), the prompt's last token and
its first decode step included), MB read, read seconds, time to first token (TTFT) and
its share spent reading, the peak memory against the plan's estimate for the prompt, and
whether the first tokens equal stock's. `--iobound MB` runs the engine's rows in a
memory cgroup of MB (benchmarks/peers/cgroup.py, root), with the checkpoint's pages
dropped first, so reads come from the disk as on a machine smaller than the model.

`--plans` prints the expert chunk `llm mlxs plan` computes for real models (their
config.json shapes: REAL below) at 24, 48 and 128 GB on an Apple silicon Mac (Metal's
fused attention), for an agent's 20k-token first prompt, a 60k one and one as long as
the context `max_context` auto gives; the passes over the experts are ceil(prompt /
chunk), where mlx-lm's 2048-token chunks make ceil(prompt / 2048).

On this 2-core CPU a prefill's compute is most of its TTFT; what the expert chunk saves
is its reads (`read s`). The projection for a real model on a Mac multiplies the passes
saved by the model's expert bytes over a Mac SSD's published read rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CACHE = Path(__file__).resolve().parent / ".cache"
ARCHS = {"qwen3_moe": "attention", "qwen3_5_moe": "hybrid linear", "gpt_oss": "sliding window"}
SHAPE = dict(quant="4bit", hidden_size=128, num_layers=2, num_experts=32, top_k=2, moe_intermediate_size=512,
             max_position_embeddings=32768, head_dim=64)
BUDGET = "16GB"
# Real models' shapes, from their config.json (transformers' Qwen3NextConfig, DeepseekV3Config and
# GptOssConfig defaults are these models'; Qwen3.5-397B-A17B's as THUDM/slime's
# scripts/models/qwen3.5-397B-A17B.sh gives them), with their own context.
REAL = {
    "Qwen3.5-397B-A17B": dict(model_type="qwen3_5_moe", hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                              num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                              linear_num_value_heads=64, linear_num_key_heads=16, linear_key_head_dim=128,
                              linear_value_head_dim=128, full_attention_interval=4, max_position_embeddings=262144),
    "Qwen3-Next-80B-A3B": dict(model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                               linear_value_head_dim=128, full_attention_interval=4, max_position_embeddings=262144),
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=36, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
                         intermediate_size=2880, sliding_window=128,
                         layer_types=["sliding_attention", "full_attention"] * 18, max_position_embeddings=131072),
    "DeepSeek-V3": dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=2048, intermediate_size=18432, kv_lora_rank=512, qk_rope_head_dim=64,
                        first_k_dense_replace=3, n_shared_experts=1, max_position_embeddings=163840),
}


def checkpoint(arch: str) -> Path:
    from fixtures.factory import build_checkpoint

    return build_checkpoint(CACHE / f"cold-prompt-{arch}", arch, **SHAPE)


def prompt_for(path: Path, n: int) -> list[int]:
    import numpy as np

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return [int(t) for t in np.random.default_rng(n).integers(0, vocab, n)]


def stock_row(path: Path, prompt: list[int]) -> dict:
    """Stock mlx-lm, every expert resident: TTFT and the first tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    mx.eval(model.parameters())
    start = time.perf_counter()
    tokens, ttft = [], None
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=3, prefill_step_size=2048):
        ttft = ttft or time.perf_counter() - start
        tokens.append(int(token))
    return {"ttft": ttft, "tokens": tokens}


def engine_row(path: Path, prompt: list[int], slots: int, mode: str) -> dict:
    """The engine at `slots` per layer, the prompt cold, `mode` before or after."""
    import mlx.core as mx

    from llm_mlx_streaming.engine.footprint import checkpoint_layout
    from llm_mlx_streaming.engine.manager import EngineManager
    from llm_mlx_streaming.engine.planner import prefill_step_for
    from llm_mlx_streaming.engine.request import Request

    layout = checkpoint_layout(path)
    chunk = prefill_step_for(path, BUDGET, max_context=32768, layout=layout)
    step = 2048 if mode == "before" else chunk
    engine = EngineManager()
    engine.load(path, expert_slots=slots, overlap="auto")
    mx.reset_peak_memory()
    generation = engine.run(None, Request(prompt=prompt, max_tokens=3, prefill_step=step, max_context=32768))
    tokens = [r.token for r in generation]
    stats = generation.stats
    pool = sum(p.slots for p in engine.loaded.pools) * layout.expert_bytes[0]
    calls = stats["prefill_calls"]
    held = stats["prefill_step"]
    planned = (layout.dense_bytes + pool + chunk.kv_bytes(len(prompt)) + chunk.fixed
               + chunk.scores_per_key * len(prompt) + chunk.per_token * min(held, len(prompt)))
    engine.unload()
    return {"tokens": tokens, "passes": stats["expert_passes"], "mb": stats["prefill_mb_read"],
            "read_s": stats["prefill_read_seconds"], "ttft": stats["ttft_seconds"], "calls": calls,
            "peak": stats["peak_memory_bytes"], "planned": planned}


def drop_pages(path: Path) -> None:
    for shard in path.glob("*.safetensors"):
        fd = os.open(shard, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def in_child(args: list[str], cgroup) -> dict:
    """engine_row in a child process (in the cgroup): its JSON line."""
    code = ("import json, sys; sys.path.insert(0, %r); from benchmarks.cold_prompt import *; "
            "print(json.dumps(_child(sys.argv[1:])))" % str(Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         preexec_fn=cgroup.enter if cgroup else None, timeout=3600)
    if run.returncode:
        raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _child(argv: list[str]) -> dict:
    path, n, slots, mode = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    return engine_row(path, prompt_for(path, n), slots, mode)


def plans() -> None:
    """The expert chunk of real models on a Mac (see the module's docstring)."""
    from llm_mlx_streaming.engine.footprint import Layout
    from llm_mlx_streaming.engine.planner import auto_context, default_reserve, expert_chunk

    print("| model | budget | max_context (auto) | per token | chunk at 20k | passes at 20k (2048s) | "
          "chunk at 60k | chunk at the context |")
    print("|---|---|---|---|---|---|---|---|")
    for name, config in REAL.items():
        experts = config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]
        top_k = config["num_experts_per_tok"]
        layout = Layout(Path(name), config, config["model_type"], experts, top_k, dense_bytes=0, skipped_bytes=0)
        for gb in (24, 48, 128):
            budget = gb * 10**9
            context = auto_context(layout, budget)
            # a real model's pools take what the budget holds beyond the plan: the room is the reserve
            chunk = expert_chunk(layout, default_reserve(budget), max_context=context, fused=True)
            print(f"| {name} | {gb} GB | {context:,} | {chunk.per_token / 1024:.0f} KiB | {chunk.tokens(20000):,} | "
                  f"{chunk.passes(20000)} ({-(-19999 // 2048)}) | {chunk.tokens(60000):,} | "
                  f"{chunk.tokens(context):,} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", action="store_true", help="the expert chunk of real models on a Mac")
    parser.add_argument("--lengths", default="2048,12288,30720")
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--iobound", type=int, metavar="MB", help="engine rows in a memory cgroup of MB (root)")
    args = parser.parse_args()
    if args.plans:
        return plans()
    cgroup = None
    if args.iobound:
        from benchmarks.peers.cgroup import MemoryCgroup

        cgroup = MemoryCgroup(args.iobound * 10**6)
        print(cgroup.describe())
    experts = SHAPE["num_experts"]
    print(f"budget {BUDGET}; {SHAPE['num_layers']} MoE layers x {experts} experts, top-{SHAPE['top_k']}; "
          "TTFT and reads of a cold prompt; this CPU (2 cores)\n")
    print("| class | prompt | pool | run | calls | passes | MB read | read s | TTFT s | reads/TTFT | "
          "peak / planned | first tokens = stock |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for arch in args.archs.split(","):
            path = checkpoint(arch)
            for n in (int(x) for x in args.lengths.split(",")):
                prompt = prompt_for(path, n)
                stock = stock_row(path, prompt)
                print(f"| {ARCHS.get(arch, arch)} | {n} | all | stock mlx-lm | {-(-n // 2048)} | - | - | - | "
                      f"{stock['ttft']:.2f} | - | - | - |", flush=True)
                for pool, slots in (("2", 2), ("25%", experts // 4)):
                    for mode in ("before", "after"):
                        if cgroup:
                            drop_pages(path)
                            row = in_child([str(path), str(n), str(slots), mode], cgroup)
                        else:
                            row = engine_row(path, prompt, slots, mode)
                        share = row["read_s"] / row["ttft"] if row["ttft"] else 0
                        print(f"| {ARCHS.get(arch, arch)} | {n} | {pool} | {mode} | {row['calls']} | "
                              f"{row['passes']:.2f} | {row['mb']:.0f} | {row['read_s']:.2f} | {row['ttft']:.2f} | "
                              f"{share:.0%} | {row['peak'] / 1e6:.0f} / {row['planned'] / 1e6:.0f} MB | "
                              f"{'yes' if row['tokens'] == stock['tokens'] else 'NO'} |", flush=True)
    finally:
        if cgroup:
            cgroup.close()


if __name__ == "__main__":
    main()
