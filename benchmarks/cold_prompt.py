"""A cold prompt reads each expert once: an agent's first turn at the speed of one pass.

    python benchmarks/cold_prompt.py [--lengths 2048,12288,30720] [--archs ...] [--iobound MB]

Per architecture class (attention qwen3_moe, hybrid linear qwen3_5_moe, sliding window
gpt_oss: tiny random 4-bit checkpoints, 32 experts, top-2, 4 MoE layers, a 32k context),
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
SHAPE = dict(quant="4bit", hidden_size=256, num_layers=4, num_experts=32, top_k=2, moe_intermediate_size=1024,
             max_position_embeddings=32768, head_dim=64)
BUDGET = "16GB"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,12288,30720")
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--iobound", type=int, metavar="MB", help="engine rows in a memory cgroup of MB (root)")
    args = parser.parse_args()
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
