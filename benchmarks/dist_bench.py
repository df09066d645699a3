"""One machine against a pipeline of two: the same memory per machine, twice the slots
per layer.

    python benchmarks/dist_bench.py [--tokens N] [--experts E] [--layers L]

A random float32 qwen3_moe checkpoint (E experts, top-4, L layers) is built once. One
process holds E/4 slots in every layer (25% of the experts resident); two local ranks,
started with `mlx.launch --backend ring`, each hold the same bytes of slots over half
the layers, so E/2 slots per layer of their own. The ranks' greedy tokens must equal one
process's at E/2 slots (a prefill with fewer slots than distinct experts runs
expert-major and may round differently, so E/4 is compared by figures only). Printed: decode tok/s, hit rate, MB read per generated token (in
total and per rank) and each rank's time waiting for the other. The ranks share this
machine's cores, so tok/s is indicative; hit rate and MB per token are the result.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rank_main(job: dict) -> None:
    """One rank under mlx.launch: rank 0 generates and writes its figures."""
    from llm_mlx_streaming.distributed.engine import PipelineEngine, follow
    from llm_mlx_streaming.distributed.group import init

    group = init("ring")
    if group.rank != 0:
        follow(group)
        return
    engine = PipelineEngine(group)
    tokens, stats = run(engine, job)
    Path(job["out"]).write_text(json.dumps({"tokens": tokens, "stats": stats}))
    engine.shutdown()


def run(engine, job: dict):
    """Load, warm up on one prompt, then measure a generation of `tokens`."""
    from llm_mlx_streaming.engine.request import LoadSpec, Request

    list(engine.queue_load(LoadSpec(job["checkpoint"], expert_slots=job["slots"])))
    list(engine.run(None, Request(job["warmup"], max_tokens=4)))
    generation = engine.run(None, Request(job["prompt"], max_tokens=job["tokens"]))
    tokens = [r.token for r in generation]
    return tokens, generation.stats


def single(job: dict):
    from llm_mlx_streaming.engine.manager import EngineManager

    return run(EngineManager(), job)


def pipeline(job: dict, ranks: int, out: Path):
    launcher = Path(sys.executable).with_name("mlx.launch")
    port = random.randrange(20000, 60000)
    command = [str(launcher), "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(ranks),
               "--starting-port", str(port), sys.executable, __file__, "--rank-job",
               json.dumps({**job, "out": str(out)})]
    subprocess.run(command, cwd=ROOT, check=True, timeout=1800)
    result = json.loads(out.read_text())
    return result["tokens"], result["stats"]


def row(label: str, stats: dict, generated: int) -> str:
    return (f"{label:<22} {stats['decode_tps']:>8.2f} {stats['hit_rate']:>8.3f} "
            f"{stats['bytes_read'] / 1e6 / generated if 'bytes_read' in stats else stats['mb_read'] / generated:>10.3f} "
            + (f"{stats['wait_seconds']:>9.3f}" if "wait_seconds" in stats else f"{'-':>9}"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank-job")
    args = parser.parse_args()
    if args.rank_job:
        rank_main(json.loads(args.rank_job))
        return
    from fixtures.factory import build_checkpoint

    folder = Path(tempfile.mkdtemp(prefix="dist-bench-"))
    path = build_checkpoint(folder / "ckpt", "qwen3_moe", num_layers=args.layers, num_experts=args.experts,
                            top_k=4, hidden_size=256, moe_intermediate_size=256)
    rng = random.Random(0)
    warmup = [rng.randrange(260, 500) for _ in range(16)]
    job = {"checkpoint": str(path), "warmup": warmup, "prompt": warmup + [rng.randrange(260, 500) for _ in range(8)],
           "tokens": args.tokens}
    _, one = single({**job, "slots": args.experts // 4})
    same_tokens, _ = single({**job, "slots": args.experts // 2})
    two_tokens, two = pipeline({**job, "slots": args.experts // 2}, 2, folder / "out.json")
    assert same_tokens == two_tokens, "the pipeline's tokens differ from the single process's"
    print(f"qwen3_moe {args.layers} layers x {args.experts} experts (top-4), {args.tokens} tokens, "
          "25% of the experts resident per machine; the ranks' tokens equal one process's "
          "at the same slots")
    print(f"{'':<22} {'tok/s':>8} {'hit rate':>8} {'MB/token':>10} {'wait s':>9}")
    print(row(f"1 process, {args.experts // 4} slots", one, args.tokens))
    print(row(f"2 ranks, {args.experts // 2} slots", two, args.tokens))
    for r in two["ranks"]:
        print(row(f"  rank {r['rank']} layers {r['layers'][0]}-{r['layers'][1] - 1}", {**r, "decode_tps": two["decode_tps"]},
                  args.tokens))


if __name__ == "__main__":
    main()
