"""Raw preadv without an engine: expert-sized reads, and a replay of one run's own reads."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .common import MARK, ROOT, proc_io


def read_ranges(pool, fds: dict, ranges: list, bufs: list) -> int:
    """Each (file, offset, length) range into its buffer with plain os.preadv, on `pool`."""
    def read(job):
        (file, off, length), buf = job
        view = memoryview(buf)[:length]
        got = 0
        while got < length:
            got += os.preadv(fds[file], [view[got:]], off + got)
        return length

    return sum(pool.map(read, zip(ranges, bufs)))


def raw_main(args) -> None:
    """Raw preadv throughput of expert-sized reads from the checkpoint's own files.

    Reads every (layer, expert) once, in a fixed shuffled order, in batches of `batch`
    experts (one MoE layer call's misses); each expert is its component tensors' byte
    ranges, read with os.preadv into preallocated buffers by a pool of `threads` threads
    in ascending offset order -- the pattern a miss costs, with no engine around it.
    """
    import random
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    sys.path.insert(0, str(ROOT))
    from llm_mlx_streaming.experts.index import CheckpointIndex

    experts = []  # [(file, offset, length) x ranges per expert]
    if args.source == "packed":  # our packed store: one contiguous record per expert
        folder = Path(args.path) / "mlxs-packed"
        for layer in json.loads((folder / "index.json").read_text())["layers"]:
            for e in range(layer["num_experts"]):
                experts.append([(folder / layer["file"], e * layer["record_size"], layer["expert_bytes"])])
    else:  # the safetensors: one range per component tensor (9 for a 4-bit SwiGLU)
        index = CheckpointIndex(args.path)
        layers: dict[str, list] = {}
        for name, t in index.tensors.items():
            if ".switch_mlp." in name or ".experts." in name:
                layers.setdefault(name.rsplit(".", 2)[0], []).append(t)
        for key in sorted(layers):
            comps = layers[key]
            E = comps[0].shape[0]
            for e in range(E):
                experts.append([(t.file, t.offset + e * (t.nbytes // E), t.nbytes // E) for t in comps])
    random.Random(0).shuffle(experts)
    if args.limit_experts:
        experts = experts[: args.limit_experts]
    fds = {f: os.open(f, os.O_RDONLY) for f in {r[0] for ex in experts for r in ex}}
    biggest = max(r[2] for ex in experts for r in ex)
    bufs = [np.empty(biggest, np.uint8) for _ in range(args.batch * 16)]
    pool = ThreadPoolExecutor(args.threads)

    total, seconds = 0, 0.0
    for i in range(0, len(experts), args.batch):
        ranges = sorted((r for ex in experts[i:i + args.batch] for r in ex), key=lambda r: (str(r[0]), r[1]))
        t = time.perf_counter()
        total += read_ranges(pool, fds, ranges, bufs)
        seconds += time.perf_counter() - t
    print(MARK + json.dumps({"bytes": total, "seconds": seconds, "mb_s": total / seconds / 1e6,
                             "experts": len(experts), "ranges": len(experts[0]), "batch": args.batch,
                             "source": args.source,
                             "threads": args.threads}), flush=True)


def replay_main(args) -> None:
    """Raw preadv of exactly the reads one of our runs made, from the same cache state.

    The parent leaves the page cache as it was before that run (dropped, or warm); this
    replays every recorded read call in order -- the ones before the measured decode
    unmeasured, so the page cache ends up as the engine's did -- and times the measured
    runs' decode calls: each call's ranges in ascending offset, one preadv per range, on
    a pool of `threads` threads into pre-touched buffers. Same bytes, same order, same
    tier as the engine's decode misses, with no engine around them.

    `--paced` starts each call as long after the previous one as the engine did (it
    computed in between), instead of back to back: idle reader threads, and on a VM idle
    vCPUs, take longer to wake than busy ones, so pacing is part of what a read costs.

    `--ballast BYTES` first allocates and touches that much memory (the engine's peak
    RSS): in a memory cgroup the page cache gets only what the process leaves of the
    limit, so without it the replay would keep about twice the engine's share of the
    checkpoint cached and read less from the disk than the engine did.
    """
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    ballast = np.ones(args.ballast, np.uint8) if args.ballast else None  # noqa: F841 - held
    log = json.loads(Path(args.replay).read_text())
    calls = log["calls"]
    fds = {f: os.open(f, os.O_RDONLY) for f in {r[0] for c in calls for r in c["ranges"]}}
    biggest = max(r[2] for c in calls for r in c["ranges"])
    bufs = [np.ones(biggest, np.uint8) for _ in range(max(len(c["ranges"]) for c in calls))]
    pool = ThreadPoolExecutor(args.threads)

    total, seconds, measured, disk = 0, 0.0, 0, 0
    previous = None  # (recorded start, replayed start) of the call before
    for call in calls:
        ranges = sorted(map(tuple, call["ranges"]), key=lambda r: (r[0], r[1]))
        timed = call["phase"] == "decode" and call["run"] >= log["warmup"]
        if args.paced and timed and previous:
            time.sleep(max(0.0, previous[1] + (call["t"] - previous[0]) - time.perf_counter()))
        io = proc_io() if timed else {}
        t = time.perf_counter()
        previous = (call["t"], t)
        n = read_ranges(pool, fds, ranges, bufs)
        if timed:
            seconds += time.perf_counter() - t
            total += n
            measured += 1
            disk += proc_io().get("read_bytes", 0) - io.get("read_bytes", 0)
    print(MARK + json.dumps({"bytes": total, "seconds": seconds, "mb_s": total / seconds / 1e6 if seconds else None,
                             "calls": measured, "threads": args.threads, "paced": args.paced,
                             "disk_share": disk / total if total else None, "ballast": args.ballast}), flush=True)
