"""Expert read throughput: raw preadv against the engine's safetensors and packed paths.

Builds (once, then reuses) the synthetic qwen3_moe checkpoint of engine_bench.py
(~755 MB of 4-bit experts, 1.47 MB each, 9 components), packs a private copy of it
(qwen3_moe-bench-io, so the shared one stays unpacked), then replays the
same random expert sets through each reader the way a decoding pool meets them: per
layer call, top_k (8) experts none of which is resident, all misses. Prints MB/s
(median of --repeats) for:

- raw: one plain contiguous preadv of expert_bytes per expert from the same shard,
  same threads, same ascending order, into as much memory as the pools (the ceiling),
- safetensors: ExpertPool.ensure over the checkpoint (9 reads per expert),
- packed: ExpertPool.ensure over the packed store (1 read per expert): "1st-read crc"
  is a fresh store (each record crc-checked on its first read, as when a session
  starts), "steady" has every record checked already (later in a session), "crc
  always" checks every read,

with page_cache "keep" and "bypass". Every run starts cold: the files' pages are
dropped first (posix_fadvise DONTNEED, Linux). "vs raw" is the median of the ratios
taken within each repeat (readers run in rotated order), which a shared, drifting
disk disturbs less than a ratio of medians. With --sweep it also prints the same
rows for 1, 2, 4, 8 and 16 reader threads (bypass, so every read hits the disk).

    python benchmarks/io_bench.py [--rounds 32] [--repeats 3] [--threads 8] [--sweep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.factory import build_checkpoint  # noqa: E402
from llm_mlx_streaming.checkpoints.packing import layer_maps, pack_checkpoint, verify_packed  # noqa: E402
from llm_mlx_streaming.experts.packed import open_packed, packed_dir  # noqa: E402
from llm_mlx_streaming.experts.pool import ExpertPool  # noqa: E402
from llm_mlx_streaming.experts.store import ExpertStore  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
SHAPE = dict(hidden_size=1024, moe_intermediate_size=768, num_experts=128, top_k=8, num_layers=4)
RAW = "raw preadv (1/expert)"
DTYPES = {"U32": mx.uint32, "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "U8": mx.uint8}


def workload(layers, rounds: int, k: int, seed: int = 0) -> list[list[int]]:
    """Per layer, `rounds` sets of k experts, each disjoint from the set before it."""
    rng = np.random.default_rng(seed)
    sets = []
    for layer in layers:
        seq, prev = [], set()
        for _ in range(rounds):
            choice = rng.permutation([e for e in range(layer.num_experts) if e not in prev])[:k]
            seq.append([int(e) for e in choice])
            prev = set(seq[-1])
        sets.append(seq)
    return sets


def private_copy(src: Path, dest: Path) -> Path:
    """A copy of the checkpoint for this benchmark alone: packing it leaves the one
    engine_bench.py and others use unpacked, and their processes, which map the shared
    shard, cannot keep its pages cached while this one needs cold reads."""
    dest.mkdir(exist_ok=True)
    for file in src.iterdir():
        copy = dest / file.name
        if file.is_file() and not (copy.exists() and _same(file.stat(), copy.stat())):
            shutil.copy2(file, copy)
    return dest


def _same(a, b) -> bool:
    return a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns


def drop_cache(files) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def raw(layers, sets, threads: int, page_cache: str) -> tuple[int, float]:
    """Plain expert-sized preadv from the shard, the engine's order and concurrency,
    into as much destination memory as the pools have (k buffers per layer: reusing a
    few cache-hot buffers would flatter it)."""
    fds = {}
    for layer in layers:
        file = layer.components[0].file
        if file not in fds:
            fds[file] = os.open(file, os.O_RDONLY)
            if page_cache == "bypass":  # as ExpertStore does: no readahead
                os.posix_fadvise(fds[file], 0, 0, os.POSIX_FADV_RANDOM)
    k = len(sets[0][0])
    slots = [[np.ones(l.expert_bytes, np.uint8) for _ in range(k)] for l in layers]
    pool = ThreadPoolExecutor(threads)
    nbytes = 0
    start = time.perf_counter()
    # layer i's experts are the i-th run of E expert-sized ranges of the shard: each
    # layer has its own bytes, as in the checkpoint, so the page cache is not flattered
    region = [sum(l.num_experts * l.expert_bytes for l in layers[:i]) for i in range(len(layers))]
    assert sum(l.num_experts * l.expert_bytes for l in layers) <= os.path.getsize(layers[0].components[0].file)
    for rnd in range(len(sets[0])):
        for i, (layer, seq) in enumerate(zip(layers, sets)):
            fd = fds[layer.components[0].file]
            size = layer.expert_bytes
            offsets = sorted((region[i] + e * size) // 4096 * 4096 for e in seq[rnd])
            it = iter(zip(offsets, slots[i]))
            lock = threading.Lock()

            def work(_):
                while True:
                    with lock:
                        off, buf = next(it, (None, None))
                    if off is None:
                        return
                    os.preadv(fd, [buf], off)
                    if page_cache == "bypass":
                        os.posix_fadvise(fd, off // 4096 * 4096, size + off % 4096, os.POSIX_FADV_DONTNEED)

            list(pool.map(work, range(min(threads, len(offsets)))))
            nbytes += size * len(offsets)
    seconds = time.perf_counter() - start
    pool.shutdown()
    for fd in fds.values():
        os.close(fd)
    return nbytes, seconds


def engine(path, layers, sets, threads: int, page_cache: str, packed: str | None) -> tuple[int, float]:
    """ExpertPool.ensure over pools of top_k slots: every expert of every set a miss.

    packed: None (safetensors), "first" (a fresh store: each record crc-checked on its
    first read, as at the start of a session), "steady" (every record already checked
    once, as later in a session) or "always" (crc on every read).
    """
    store = ExpertStore(threads, page_cache)
    if packed:
        store.packed = open_packed(path, layers, "always" if packed == "always" else "first")
        assert store.packed is not None, "packed store missing or invalid"
        if packed == "steady":
            for layer in store.packed.layers.values():
                layer.checked[:] = True
    k = len(sets[0][0])
    pools = [
        ExpertPool(layer, k, {c.name: DTYPES[c.dtype] for c in layer.components}, store, "lru")
        for layer in layers
    ]
    start = time.perf_counter()
    for rnd in range(len(sets[0])):
        for pool, seq in zip(pools, sets):
            pool.ensure(seq[rnd])
    seconds = time.perf_counter() - start
    assert all(p.counters.hits == 0 for p in pools)
    nbytes = sum(p.counters.bytes_read for p in pools)
    store.close()
    return nbytes, seconds


def measure(path, layers, sets, files, threads, page_cache, repeats) -> dict:
    """{reader: (median MB/s, median of its per-repeat ratio to raw)}.

    Each repeat runs every reader once, in a rotated order, each from a cold cache;
    ratios are taken within a repeat, so slow drift of a shared disk hits both sides.
    """
    runs = {
        RAW: lambda: raw(layers, sets, threads, page_cache),
        "safetensors (9/expert)": lambda: engine(path, layers, sets, threads, page_cache, None),
        "packed, 1st-read crc": lambda: engine(path, layers, sets, threads, page_cache, "first"),
        "packed, steady": lambda: engine(path, layers, sets, threads, page_cache, "steady"),
        "packed, crc always": lambda: engine(path, layers, sets, threads, page_cache, "always"),
    }
    names = list(runs)
    speed = {name: [] for name in names}
    ratio = {name: [] for name in names}
    for rep in range(repeats):
        got = {}
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            drop_cache(files)
            nbytes, seconds = runs[name]()
            got[name] = nbytes / seconds / 1e6
        for name in names:
            speed[name].append(got[name])
            ratio[name].append(got[name] / got[RAW])
    return {name: (statistics.median(speed[name]), statistics.median(ratio[name])) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=32, help="layer calls per layer")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (median)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--sweep", action="store_true", help="also sweep 1,2,4,8,16 threads")
    args = parser.parse_args()

    start = time.perf_counter()
    shared = build_checkpoint(CACHE / "qwen3_moe-bench", "qwen3_moe", quant="4bit", seed=0, **SHAPE)
    path = private_copy(shared, CACHE / "qwen3_moe-bench-io")
    layers = layer_maps(path)
    if open_packed(path, layers) is None:
        pack_checkpoint(path)
    pack_s = time.perf_counter() - start
    t = time.perf_counter()
    problems = verify_packed(path)
    verify_s = time.perf_counter() - t
    assert not problems, problems
    expert_mb = sum(l.expert_bytes * l.num_experts for l in layers) / 1e6
    files = sorted({c.file for l in layers for c in l.components}) + sorted(packed_dir(path).glob("*.bin"))
    sets = workload(layers, args.rounds, SHAPE["top_k"])
    read_mb = args.rounds * len(layers) * SHAPE["top_k"] * layers[0].expert_bytes / 1e6
    print(f"checkpoint {path}: {expert_mb:.0f} MB of experts, {layers[0].expert_bytes} B per expert "
          f"({len(layers[0].components)} components); ready and packed in {pack_s:.1f}s; "
          f"verify_packed {verify_s:.1f}s ({expert_mb / verify_s:.0f} MB/s)")
    print(f"workload: {args.rounds} calls x {len(layers)} layers x {SHAPE['top_k']} missed experts "
          f"= {read_mb:.0f} MB per run, cold start, median of {args.repeats}")

    print(f"\n{'threads':>7} {'page_cache':<10} {'reader':<24} {'MB/s':>8} {'vs raw':>7}")
    grid = [(n, "bypass") for n in (1, 2, 4, 8, 16)] if args.sweep else []
    grid += [(args.threads, "keep"), (args.threads, "bypass")]
    for threads, page_cache in grid:
        rows = measure(path, layers, sets, files, threads, page_cache, args.repeats)
        for name, (mbs, vs_raw) in rows.items():
            print(f"{threads:>7} {page_cache:<10} {name:<24} {mbs:>8.0f} {vs_raw:>6.2f}x")
        print(flush=True)


if __name__ == "__main__":
    main()
