"""Requests alternating between two and three tiny models: kept loaded (max_models = the
number of models, one shared budget) against today's unload-and-load (max_models 1).

Per request: the latency, whether it loaded a model; per model: the memory its footprint
and slots hold. Target: 0 loads in the steady state (after the first of each model), and
the same tokens either way. Run: python benchmarks/many_models.py [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.factory import build_checkpoint  # noqa: E402
from llm_mlx_streaming.engine.footprint import checkpoint_layout, model_footprint  # noqa: E402
from llm_mlx_streaming.engine.kv import FULL_PRECISION  # noqa: E402
from llm_mlx_streaming.engine.manager import EngineManager  # noqa: E402
from llm_mlx_streaming.engine.residents import Limits  # noqa: E402
from llm_mlx_streaming.engine.request import LoadSpec, Request  # noqa: E402
from llm_mlx_streaming.sizes import format_size  # noqa: E402

CACHE = Path(tempfile.gettempdir()) / "mlxs-many-models"
SHAPE = dict(hidden_size=128, num_layers=4, num_experts=16, top_k=2, moe_intermediate_size=64)
CONTEXT, RESERVE = 1024, 2**20


def run(paths: list[Path], resident: bool, rounds: int) -> dict:
    specs = []
    for p in paths:
        footprint = model_footprint(checkpoint_layout(p), CONTEXT, FULL_PRECISION, RESERVE)
        specs.append(LoadSpec(path=p, expert_slots=None, footprint=footprint))
    budget = sum(s.footprint.fixed_bytes for s in specs) + RESERVE + sum(
        s.footprint.num_experts * sum(s.footprint.expert_bytes) for s in specs)
    engine = EngineManager()
    engine.limit(Limits(max_models=len(paths) if resident else 1, budget=budget))
    prompt = list(range(3, 35))
    seconds, loads, answers = [], [], []
    for i in range(rounds * len(paths)):
        before = engine.residency().loads
        start = time.perf_counter()
        answers.append([r.token for r in engine.run(specs[i % len(paths)], Request(prompt=prompt, max_tokens=8))])
        seconds.append(time.perf_counter() - start)
        loads.append(engine.residency().loads - before)
    held = {r.path.name: r.memory_bytes for r in engine.residency().models}
    engine.unload()
    steady = slice(len(paths), None)
    return {"seconds": seconds, "loads": loads, "answers": answers, "held": held,
            "steady_loads": sum(loads[steady]), "steady_ms": 1000 * statistics.median(seconds[steady])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    paths = [build_checkpoint(CACHE / f"m{seed}", "qwen3_moe", seed=seed, **SHAPE) for seed in range(3)]
    rows = []
    for n in (2, 3):
        kept, swapped = run(paths[:n], True, args.rounds), run(paths[:n], False, args.rounds)
        rows.append({"models": n, "requests": len(kept["loads"]), "same_tokens": kept["answers"] == swapped["answers"],
                     "resident_loads": sum(kept["loads"]), "resident_steady_loads": kept["steady_loads"],
                     "resident_ms": round(kept["steady_ms"], 1), "swap_loads": sum(swapped["loads"]),
                     "swap_ms": round(swapped["steady_ms"], 1),
                     "held": {k: format_size(v) for k, v in kept["held"].items()}})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| models | requests | loads kept (steady) | loads swapping | ms/request kept | ms/request swapping "
          "| same tokens | memory each holds (kept) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['models']} | {r['requests']} | {r['resident_loads']} ({r['resident_steady_loads']}) "
              f"| {r['swap_loads']} | {r['resident_ms']} | {r['swap_ms']} | {r['same_tokens']} "
              f"| {', '.join(r['held'].values())} |")


if __name__ == "__main__":
    main()
