"""Our streaming engine against BigRig and boyle on the same synthetic checkpoint.

The peers are comparators only: they are installed from PyPI into their own virtual
environment (benchmarks/.cache/peers-venv) and driven from there, in subprocesses; none of
their code enters this repository. Every engine, stock mlx-lm included, decodes the same
prompt tokens greedily through mlx-lm's `stream_generate`, on the checkpoint that
benchmarks/engine_bench.py builds (qwen3_moe shape, 128 experts x 4 layers, 4-bit,
~755 MB of experts), with the same share of each layer's experts resident (25% and 50%),
cold (the checkpoint's pages dropped from the OS page cache, a fresh process, an empty
pool) and warm (checkpoint in the page cache, one warm-up generation first). Each engine
that has a packed copy of the experts gets it first, made the way its own setup makes it
(ours: `llm mlxs pack`'s `pack_checkpoint`; BigRig: the `ensure_packed` its CLI runs when it
installs a model); boyle reads the safetensors. `--no-pack` skips that (remove
`mlxs-packed/` and `benchmarks/.cache/bigrig-home` first to measure without them).

    python benchmarks/peers.py [--tokens 64] [--runs 2] [--repeat 3] [--fractions 0.25,0.5] [--no-pack] [--json F]
    python benchmarks/peers.py --report F      # the table again, from a --json file
    python benchmarks/peers.py --large [--large-limit-gb 16] [--large-fractions 0.1,0.25]

This machine is shared and small, so tok/s is noisy: `--repeat` interleaves whole cycles
and pools their runs, and the CPU ms/tok column (user+sys per decoded token) is the
steadier comparison. The I/O-efficiency line compares the engine's decode reads
(bytes_read / read_seconds) with raw `preadv` of exactly the same read calls, replayed
without the engine from the same page-cache state (`--reads` records them, `--replay`
replays them).

Columns: decode tok/s (mlx-lm's generation_tps), time to first token (prefill included,
load excluded), MB read per decoded token as each engine counts it (`engine MB/tok`:
our bytes_read, BigRig's fetch_gb, boyle's misses x bytes per expert) and as the kernel
counts it (`disk MB/tok`: /proc/self/io read_bytes, i.e. storage reads, 0 when the page
cache serves them), decode hit rate from each engine's own counters, peak RSS of the
process, and whether the generated tokens equal stock mlx-lm's.

The peers declare macOS only. On Linux each needs a shim for Apple-only calls, applied
from outside in the child process (their files are not changed); the table shows first
what happens as shipped, then the shimmed run. `--no-shims` skips the shimmed runs.

`--large` builds once (benchmarks/.cache/qwen3_moe-large, ~27 GB of 4-bit experts, more
than this machine's memory) with a streaming writer (the factory holds a whole model in
memory, so it cannot build this), then runs stock mlx-lm and our engine, each in a
subprocess under the same address-space limit (RLIMIT_AS), cold.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(__file__).resolve().parent / ".cache"
PEERS_VENV = CACHE / "peers-venv"
BIGRIG_HOME = CACHE / "bigrig-home"
PEERS = {"bigrig": ("bigrig", "0.9.1", "bigrig_engine"), "boyle": ("boyle", "0.2.1", "boyle")}
SHAPE = dict(hidden_size=1024, moe_intermediate_size=768, num_experts=128, top_k=8, num_layers=4)
PROMPT = list(range(3, 35))  # the prompt engine_bench.py uses: 32 token ids
MARK = "@@RESULT "

# --large: 48 layers x 384 experts x 1.47 MB = 27.2 GB (25.3 GiB) of 4-bit experts
LARGE_SHAPE = dict(hidden_size=1024, moe_intermediate_size=768, num_experts=384, top_k=8, num_layers=48)
LARGE_LAYERS_PER_SHARD = 4
LARGE_VERSION = 1


# =====================================================================================
# Child side: runs in the peers venv (bigrig, boyle) or the project venv (stock, ours).
# Imports nothing from this repository unless it is the "ours" engine.
# =====================================================================================

def _proc_io() -> dict:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _where(exc: BaseException, package: str | None) -> str:
    """file:line and source of the innermost frame in `package` (else the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    pick = None
    for fr in frames:
        if package and f"/{package}/" in fr.filename:
            pick = fr
    pick = pick or (frames[-1] if frames else None)
    if pick is None:
        return ""
    name = pick.filename
    if package and f"/{package}/" in name:
        name = package + "/" + name.split(f"/{package}/", 1)[1]
    return f"{name}:{pick.lineno}: {(pick.line or '').strip()}"


class _Stock:
    name = "stock"

    def __init__(self, path: str, fraction: float, shims: bool):
        from mlx_lm import load

        self.model, self.tokenizer = load(path)

    def generate(self, prompt, max_tokens):
        from mlx_lm import stream_generate

        return stream_generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens)

    def counters(self):
        return None


class _Ours:
    name = "ours"

    def __init__(self, path: str, fraction: float, shims: bool):
        sys.path.insert(0, str(ROOT))
        from llm_mlx_streaming.engine.manager import EngineManager

        config = json.loads((Path(path) / "config.json").read_text())
        self.slots = max(1, round(config["num_experts"] * fraction))
        self.engine = EngineManager()
        self.engine.load(path, expert_slots=self.slots)  # the engine's default policy
        self.policy = self.engine.policy
        store = self.engine.loaded.store
        self.packed = getattr(store, "packed", None) is not None  # one read per expert
        # Every read call's start time and byte ranges, tagged with its run and phase, for --replay
        self.reads: list[dict] = []
        self._phase = {"run": -1, "phase": "load"}
        read = store.read

        def recorded(jobs, verify=None):
            self.reads.append({**self._phase, "t": time.perf_counter(),
                               "ranges": [(str(f), off, sum(b.nbytes for b in bufs)) for f, off, bufs in jobs]})
            return read(jobs, verify)

        store.read = recorded

    def generate(self, prompt, max_tokens):
        self.engine.session.reset()  # no KV reuse between runs: every run prefills
        self._phase = {"run": self._phase["run"] + 1, "phase": "prefill"}
        for r in self.engine.generate(prompt, max_tokens=max_tokens):
            yield r
            self._phase["phase"] = "decode"  # what follows the first token

    def counters(self):
        c = self.engine.counters()
        return {"hits": c.hits, "misses": c.misses, "bytes": c.bytes_read, "read_seconds": c.read_seconds}


def _shim_bigrig() -> list[str]:
    """bigrig_engine/calibrate.py asks macOS `vm_stat` for free memory; Linux has /proc/meminfo."""
    from bigrig_engine import calibrate

    page = calibrate.PAGE

    def vm(key: str) -> int:
        return _meminfo_bytes("MemAvailable") // page if key == "Pages free" else 0

    calibrate._vm = vm
    return ["calibrate._vm: /proc/meminfo MemAvailable instead of macOS `vm_stat`"]


class _BigRig:
    name = "bigrig"

    def __init__(self, path: str, fraction: float, shims: bool):
        self.shims = _shim_bigrig() if shims else []
        from bigrig_engine.session import Session

        # capacity: their explicit residency; warm=False: start with an empty pool like the
        # others; persistence and the quality meter are serving features, off here.
        self.session = Session(path, capacity=fraction, verbose=False, monitor=False, warm=False,
                               persist=False, remember=False, budget_gb=8.0)
        self.model, self.tokenizer = self.session.model, self.session.tokenizer
        self.slots = int(self.session.plan.get("capacity") or 0)

    def generate(self, prompt, max_tokens):
        from mlx_lm import stream_generate

        return stream_generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens)

    def counters(self):
        h = self.session.handle
        if h is None:
            return None
        s = h.stats()
        return {"hits": s["hits"], "misses": s["misses"], "bytes": int(round(s["fetch_gb"] * 1e9)),
                "read_seconds": s.get("fetch_seconds", 0.0)}


def _shim_boyle() -> list[str]:
    """boyle/loader.py wants Metal's working-set size; boyle/_runtime.py wants macOS F_NOCACHE."""
    import fcntl

    import mlx.core as mx

    notes = []
    info = mx.device_info
    if "max_recommended_working_set_size" not in info():
        total = _meminfo_bytes("MemTotal")
        mx.device_info = lambda: {**info(), "max_recommended_working_set_size": total}
        notes.append("mx.device_info(): max_recommended_working_set_size = MemTotal (CPU MLX has none)")
    if not hasattr(fcntl, "F_NOCACHE"):
        fcntl.F_NOCACHE = fcntl.F_GETFD  # fcntl(fd, F_GETFD, 1): a no-op, reads stay cached
        notes.append("fcntl.F_NOCACHE -> F_GETFD no-op (Linux has no F_NOCACHE: page cache stays on)")
    return notes


class _Boyle:
    name = "boyle"

    def __init__(self, path: str, fraction: float, shims: bool):
        self.shims = _shim_boyle() if shims else []
        import boyle.loader as loader
        from boyle.budget import parse_size

        anatomy = loader.read_anatomy(path)
        caps = anatomy.capacities_for(fraction)
        # boyle takes a byte budget: the one that buys exactly `fraction` of each layer
        budget = (anatomy.resident_bytes + anatomy.kv_bytes_per_token * 4096
                  + parse_size("4GB") + anatomy.slots_bytes(caps))
        self.m = loader.load(path, budget=budget, max_context=4096)
        self.slots = min(self.m.plan.capacities)
        self.per_expert = [b // n for n, b in anatomy.layers]
        self._stats = loader.offload_stats

    def generate(self, prompt, max_tokens):
        from mlx_lm import stream_generate

        return stream_generate(self.m.model, self.m.tokenizer, prompt, max_tokens=max_tokens)

    def counters(self):
        s = self._stats(self.m.model)
        # boyle counts hits and misses but not bytes: misses x bytes per expert
        return {"hits": s["hits"], "misses": s["misses"],
                "bytes": s["misses"] * (sum(self.per_expert) // len(self.per_expert)), "read_seconds": None}


ENGINES = {"stock": _Stock, "ours": _Ours, "bigrig": _BigRig, "boyle": _Boyle}
# BigRig's default runs experts from the file's mmapped pages (its "file pool": the page
# cache is its pool, and its RSS counts those pages); its slot pool copies experts into
# slots, as ours and boyle's do. Both are measured; they are BigRig's own switches.
VARIANTS = {"slot pool": {"BIGRIG_VIEWS_PREFILL": "0", "BIGRIG_VIEWS_DECODE": "0"}}


def _one_run(eng, prompt: list[int], tokens: int) -> dict:
    import mlx.core as mx

    def cpu():
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    mx.reset_peak_memory()
    c0, io0 = eng.counters(), _proc_io()
    start = time.perf_counter()
    ttft, c1, io1, cpu1, out, last = None, None, None, None, [], None
    for r in eng.generate(prompt, tokens):
        if ttft is None:
            ttft = time.perf_counter() - start
            c1, io1, cpu1 = eng.counters(), _proc_io(), cpu()  # prefill done: what follows is decode
        out.append(int(r.token))
        last = r
    c2, io2, cpu2 = eng.counters(), _proc_io(), cpu()
    n = max(len(out) - 1, 1)
    res = {"tps": last.generation_tps, "ttft": ttft, "tokens": out, "seconds": time.perf_counter() - start,
           "mlx_peak": int(mx.get_peak_memory()), "cpu_ms_tok": (cpu2 - cpu1) * 1e3 / n}
    if io0:
        res["disk_mb_tok"] = (io2["read_bytes"] - io1["read_bytes"]) / 1e6 / n
        res["rchar_mb_tok"] = (io2["rchar"] - io1["rchar"]) / 1e6 / n
        res["prefill_disk_mb"] = (io1["read_bytes"] - io0["read_bytes"]) / 1e6
    if c2 is not None:
        lookups = (c2["hits"] - c1["hits"]) + (c2["misses"] - c1["misses"])
        res["hit_rate"] = (c2["hits"] - c1["hits"]) / lookups if lookups else None
        res["mb_tok"] = (c2["bytes"] - c1["bytes"]) / 1e6 / n
        res["decode_bytes"] = c2["bytes"] - c1["bytes"]
        res["prefill_mb"] = (c1["bytes"] - c0["bytes"]) / 1e6
        if c2.get("read_seconds") is not None:
            res["decode_read_seconds"] = c2["read_seconds"] - c1["read_seconds"]
    return res


def child_main(args) -> None:
    result: dict = {"engine": args.child, "fraction": args.fraction}
    package = PEERS[args.child][2] if args.child in PEERS else None
    try:
        t = time.perf_counter()
        eng = ENGINES[args.child](args.path, args.fraction, not args.no_shims)
        result["load_seconds"] = time.perf_counter() - t
        result["slots"] = getattr(eng, "slots", None)
        result["shims"] = getattr(eng, "shims", [])
        result["policy"] = getattr(eng, "policy", None)
        result["packed"] = getattr(eng, "packed", None)
        prompt = [int(x) for x in args.prompt.split(",")]
        for _ in range(args.warmup):
            _one_run(eng, prompt, args.tokens)
        result["runs"] = [_one_run(eng, prompt, args.tokens) for _ in range(args.runs)]
        if args.reads and hasattr(eng, "reads"):
            Path(args.reads).write_text(json.dumps({"warmup": args.warmup, "calls": eng.reads}))
    except BaseException as e:  # noqa: BLE001 -- reported in the table, not raised
        result["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        result["where"] = _where(e, package)
    result["peak_rss"] = _peak_rss()
    print(MARK + json.dumps(result), flush=True)


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
    """
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    log = json.loads(Path(args.replay).read_text())
    calls = log["calls"]
    fds = {f: os.open(f, os.O_RDONLY) for f in {r[0] for c in calls for r in c["ranges"]}}
    biggest = max(r[2] for c in calls for r in c["ranges"])
    bufs = [np.ones(biggest, np.uint8) for _ in range(max(len(c["ranges"]) for c in calls))]
    pool = ThreadPoolExecutor(args.threads)

    total, seconds, measured = 0, 0.0, 0
    previous = None  # (recorded start, replayed start) of the call before
    for call in calls:
        ranges = sorted(map(tuple, call["ranges"]), key=lambda r: (r[0], r[1]))
        timed = call["phase"] == "decode" and call["run"] >= log["warmup"]
        if args.paced and timed and previous:
            time.sleep(max(0.0, previous[1] + (call["t"] - previous[0]) - time.perf_counter()))
        t = time.perf_counter()
        previous = (call["t"], t)
        n = read_ranges(pool, fds, ranges, bufs)
        if timed:
            seconds += time.perf_counter() - t
            total += n
            measured += 1
    print(MARK + json.dumps({"bytes": total, "seconds": seconds, "mb_s": total / seconds / 1e6 if seconds else None,
                             "calls": measured, "threads": args.threads, "paced": args.paced}), flush=True)


# =====================================================================================
# Parent side: the project venv.
# =====================================================================================

def ensure_peers_venv() -> Path:
    """benchmarks/.cache/peers-venv with bigrig and boyle (no deps) + the MLX we run."""
    from importlib.metadata import version

    py = PEERS_VENV / "bin" / "python"
    mlx_v, mlx_lm_v = version("mlx"), version("mlx-lm")
    want = {"bigrig": PEERS["bigrig"][1], "boyle": PEERS["boyle"][1], "mlx": mlx_v, "mlx-lm": mlx_lm_v}
    check = ("import importlib.metadata as m, json; "
             f"print(json.dumps({{k: m.version(k) for k in {list(want)!r}}}))")
    if py.exists():
        got = subprocess.run([str(py), "-c", check], capture_output=True, text=True)
        if got.returncode == 0 and json.loads(got.stdout) == want:
            return py
    print(f"installing peers into {PEERS_VENV} ...", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # Both wheels declare macOS; bigrig's MLX requirements are for darwin/arm64 only, so the
    # wheels go in without dependencies and the MLX we benchmark with is installed beside them.
    subprocess.run(pip + ["--no-deps"] + [f"{n}=={v}" for n, v, _ in PEERS.values()], check=True)
    mlx_req = "mlx" if sys.platform == "darwin" else "mlx[cpu]"
    subprocess.run(pip + [f"{mlx_req}=={mlx_v}", f"mlx-lm=={mlx_lm_v}", "numpy", "huggingface_hub"], check=True)
    return py


def bigrig_blob(path: Path) -> Path:
    """Where BigRig keeps its packed copy of a checkpoint's experts (its own default)."""
    return BIGRIG_HOME / "data" / "blobs" / f"{path.name}.experts"


def reads_file(cache: str) -> Path:
    """Where our run at the first residency records its read calls (--reads, --replay)."""
    return CACHE / f"reads-{cache}.json"


def shard_files(path: Path) -> list[Path]:
    """The checkpoint's weight files and the packed copies of its experts that exist:
    ours (`llm mlxs pack`) and BigRig's; a cold run drops them all from the page cache."""
    blob = bigrig_blob(path)
    return (sorted(path.glob("*.safetensors")) + sorted(path.glob("mlxs-packed/*.bin"))
            + ([blob] if blob.exists() else []))


def pack_all(path: Path, peers_py: str) -> None:
    """Each engine's own packed copy, as its setup makes one: ours with `llm mlxs pack`'s
    function, BigRig's with the function its CLI calls when it installs a model. boyle
    has none: it reads the safetensors."""
    from llm_mlx_streaming.experts.packed import INDEX_NAME, pack_checkpoint, packed_dir

    if not (packed_dir(path) / INDEX_NAME).exists():  # a stale one: the engine says so and the table shows it
        t = time.perf_counter()
        pack_checkpoint(path)
        print(f"packed ours in {time.perf_counter() - t:.1f}s", flush=True)
    if not bigrig_blob(path).exists():
        t = time.perf_counter()
        subprocess.run([peers_py, str(Path(__file__).resolve()), "--pack-bigrig", "--path", str(path)],
                       check=True, env={**os.environ, "BIGRIG_HOME": str(BIGRIG_HOME)}, capture_output=True)
        print(f"packed BigRig's blob in {time.perf_counter() - t:.1f}s", flush=True)


def pack_bigrig_main(args) -> None:
    """Child side of pack_all, in the peers venv."""
    _shim_bigrig()
    from bigrig_engine import stream

    stream.ensure_packed(args.path, "", verbose=False)


def cached_fraction(files: list[Path]) -> float | None:
    """Share of the files' bytes in the page cache (util-linux fincore), None if unknown."""
    if not shutil.which("fincore"):
        return None
    res = size = 0
    for f in files:
        if not f.exists():
            continue
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(f)],
                             capture_output=True, text=True)
        if out.returncode != 0 or not out.stdout.split():
            return None
        r, s = out.stdout.split()[:2]
        res, size = res + int(r), size + int(s)
    return res / size if size else None


def drop_cache(files: list[Path]) -> str:
    """Evict the checkpoint from the page cache; returns how (and what is left)."""
    how = "unsupported"
    if hasattr(os, "posix_fadvise"):
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY)
            except FileNotFoundError:  # the cache folder is shared: a file may come and go
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        how = "fadvise"
    left = cached_fraction(files)
    if (left is None or left > 0.01) and os.path.exists("/proc/sys/vm/drop_caches"):
        try:
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("1\n")
            how += "+drop_caches"
            left = cached_fraction(files)
        except OSError:
            pass
    return how if left is None else f"{how}, {left:.1%} left cached"


def warm_cache(files: list[Path]) -> str:
    for f in files:
        try:
            with open(f, "rb", buffering=0) as fh:
                while fh.read(16 << 20):
                    pass
        except FileNotFoundError:
            continue
    left = cached_fraction(files)
    return "read" if left is None else f"read, {left:.1%} cached"


def run_child(python: str, argv: list[str], timeout: float, env: dict | None = None,
              as_limit: int | None = None) -> dict:
    """Run one child; its @@RESULT line, or a row saying why there is none."""
    def limit():
        if as_limit:
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))

    cmd = [python, str(Path(__file__).resolve())] + argv
    full_env = {**os.environ, **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=str(ROOT), preexec_fn=limit)
    hwm = [0]
    done = threading.Event()

    def sample():  # peak RSS seen from outside, which survives a crash or a kill
        while not done.wait(0.2):
            try:
                with open(f"/proc/{proc.pid}/status") as fh:
                    for line in fh:
                        if line.startswith("VmHWM:"):
                            hwm[0] = max(hwm[0], int(line.split()[1]) * 1024)
            except OSError:
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        timed_out = True
    done.set()
    elapsed = time.perf_counter() - start
    for line in out.splitlines():
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            res["wall"] = elapsed
            res["peak_rss"] = max(res.get("peak_rss") or 0, hwm[0])
            res["rc"] = proc.returncode
            return res
    tail = [l for l in err.strip().splitlines() if l.strip()][-1:] or [f"exit code {proc.returncode}"]
    why = f"timed out after {timeout:.0f}s" if timed_out else tail[0].strip()[:300]
    if proc.returncode and proc.returncode < 0:
        why = f"killed by signal {-proc.returncode}; {why}"
    return {"error": why, "rc": proc.returncode, "wall": elapsed, "peak_rss": hwm[0],
            "stderr_tail": err.strip().splitlines()[-15:]}


def child_argv(engine: str, path: Path, fraction: float, tokens: int, runs: int, warmup: int,
               shims: bool = True) -> list[str]:
    argv = ["--child", engine, "--path", str(path), "--fraction", str(fraction), "--tokens", str(tokens),
            "--runs", str(runs), "--warmup", str(warmup), "--prompt", ",".join(map(str, PROMPT))]
    return argv + ([] if shims else ["--no-shims"])


def summarise(res: dict) -> dict:
    """Median over the measured runs (by decode tok/s)."""
    runs = res.get("runs") or []
    if not runs:
        return res
    pick = sorted(runs, key=lambda r: r["tps"])[len(runs) // 2]
    out = dict(res)
    out.update({k: v for k, v in pick.items()})
    out["tps"] = statistics.median(r["tps"] for r in runs)
    out["ttft"] = statistics.median(r["ttft"] for r in runs)
    out["cpu_ms_tok"] = statistics.median(r["cpu_ms_tok"] for r in runs)
    out["all_tokens"] = [r["tokens"] for r in runs]
    return out


def fmt(v, spec, dash="-"):
    return dash if v is None else format(v, spec)


def print_table(rows: list[dict], reference: list[int] | None) -> list[str]:
    head = (f"{'engine':<34} {'resident':>9} {'cache':>5} {'decode tok/s':>12} {'CPU ms/tok':>10} {'TTFT s':>7} "
            f"{'load s':>6} {'engine MB/tok':>13} {'disk MB/tok':>11} {'hit rate':>8} {'peak RSS MB':>11}  tokens = stock")
    lines = [head, "-" * len(head)]
    for r in rows:
        label = r["label"]
        resident = r.get("resident", "")
        if "error" in r:
            lines.append(f"{label:<34} {resident:>9} {r.get('cache', ''):>5}  not runnable here: {r['error']}")
            continue
        toks = r.get("all_tokens") or [r.get("tokens")]
        if reference is None:
            same = "-"
        else:
            same = "yes" if all(t == reference for t in toks) else "NO"
        disk = fmt(r.get('disk_mb_tok'), '.2f')
        if r["cache"] == "warm" and (r.get("disk_mb_tok") or 0) > 1:
            disk += "*"  # the page cache was emptied under the run (the cache folder is shared)
        lines.append(
            f"{label:<34} {resident:>9} {r['cache']:>5} {r['tps']:>12.2f} {fmt(r.get('cpu_ms_tok'), '10.0f'):>10} "
            f"{r['ttft']:>7.2f} {fmt(r.get('load_seconds'), '6.1f'):>6} {fmt(r.get('mb_tok'), '13.2f'):>13} "
            f"{disk:>11} {fmt(r.get('hit_rate'), '8.3f'):>8} {r['peak_rss'] / 1e6:>11.0f}  {same}")
    print("\n".join(lines), flush=True)
    return lines


def merge(found: list[dict]) -> dict:
    """One row from the repeats: every measured run pooled, medians taken."""
    ok = [r for r in found if "error" not in r]
    if not ok:
        return found[0]
    merged = dict(ok[0])
    merged["runs"] = [run for r in ok for run in r["runs"]]
    merged["peak_rss"] = max(r["peak_rss"] for r in ok)
    merged["load_seconds"] = statistics.median(r["load_seconds"] for r in ok)
    merged["packed"] = all(r.get("packed") for r in ok) if ok[0].get("packed") is not None else None
    if len(ok) < len(found):
        merged["failed_repeats"] = [r["error"] for r in found if "error" in r]
    return summarise(merged)


def normal_main(args) -> None:
    sys.path.insert(0, str(ROOT))
    from llm_mlx_streaming.checkpoints.factory import build_checkpoint
    from llm_mlx_streaming.experts.index import CheckpointIndex

    t_all = time.perf_counter()
    path = build_checkpoint(CACHE / "qwen3_moe-bench", "qwen3_moe", quant="4bit", seed=0, **SHAPE)
    index = CheckpointIndex(path)
    expert_mb = sum(t.nbytes for k, t in index.tensors.items() if "switch_mlp" in k) / 1e6
    files = shard_files(path)
    print(f"checkpoint {path} ({expert_mb:.0f} MB of experts)", flush=True)
    peers_py = str(ensure_peers_venv())
    ours_py = sys.executable
    if not args.no_pack:
        pack_all(path, peers_py)
    for cache in ("cold", "warm"):
        reads_file(cache).unlink(missing_ok=True)  # an earlier run's
    env = {"BIGRIG_HOME": str(BIGRIG_HOME)}
    fractions = [float(f) for f in args.fractions.split(",")]
    T = args.timeout
    log: list[dict] = []
    loads: list[float] = []

    def measure(engine, fraction, cache, shims=True, variant=""):
        py = ours_py if engine in ("stock", "ours") else peers_py
        files = shard_files(path)  # re-listed: the packed store may have appeared or gone
        prep = drop_cache(files) if cache == "cold" else warm_cache(files)
        runs, warmup = (1, 0) if cache == "cold" else (args.runs, 1)
        t = time.perf_counter()
        load0 = os.getloadavg()[0]
        argv = child_argv(engine, path, fraction, args.tokens, runs, warmup, shims)
        if engine == "ours" and fraction == fractions[0]:  # its reads, for the I/O-efficiency replay
            argv += ["--reads", str(reads_file(cache))]
        res = run_child(py, argv, T, {**env, **VARIANTS.get(variant, {})})
        res.update(cache=cache, prep=prep, engine=engine, fraction=fraction, variant=variant,
                   loadavg=(load0, os.getloadavg()[0]))
        loads.extend(res["loadavg"])
        tps = [f"{r['tps']:.2f}" for r in res.get("runs", [])]
        print(f"  {engine + (' ' + variant if variant else ''):<17} {fraction:>5.0%} {cache:<4} ({prep}): "
              + (f"{', '.join(tps)} tok/s" if "error" not in res else res["error"])
              + f"  [{time.perf_counter() - t:.0f}s, load {load0:.1f}]", flush=True)
        log.append(res)
        return res

    engines = [("ours", "")] + ([] if args.no_shims else [(p, "") for p in PEERS] + [("bigrig", "slot pool")])
    found: dict = {}
    shipped = {}
    miss_batch = 6  # about a decode layer call's misses at 25% (top-8, hit rate ~0.25)
    raw: dict = {"cold": [], "warm": []}
    replay: dict = {"cold": [], "warm": []}
    for cycle in range(args.repeat):
        if args.repeat > 1:
            print(f"cycle {cycle + 1} of {args.repeat}", flush=True)
        # 1. stock mlx-lm: the reference tokens and speed
        for cache in ("cold", "warm"):
            found.setdefault(("stock", 1.0, cache), []).append(measure("stock", 1.0, cache))
        # 2. the peers as shipped: do they run on Linux at all? (once)
        if cycle == 0:
            for peer in PEERS:
                shipped[peer] = measure(peer, 0.25, "cold", shims=False)
        # 3. every engine at each residency, cold and warm
        for fraction in fractions:
            for cache in ("cold", "warm"):
                for engine, variant in engines:
                    key = (engine + (f" {variant}" if variant else ""), fraction, cache)
                    found.setdefault(key, []).append(measure(engine, fraction, cache, variant=variant))
        # 4. raw preadv of expert-sized reads, cold and warm, for the I/O efficiency line
        ours_cold = found.get(("ours", fractions[0], "cold"), [{}])[-1]
        source = "packed" if ours_cold.get("packed") else "safetensors"
        for cache in ("cold", "warm"):
            files = shard_files(path)
            prep = drop_cache(files) if cache == "cold" else warm_cache(files)
            r = run_child(ours_py, ["--raw", "--path", str(path), "--batch", str(miss_batch),
                                    "--threads", "8", "--source", source], T)
            r["prep"] = prep
            raw[cache].append(r)
        # 5. raw preadv of exactly our decode reads, from the cache state our run started in,
        #    paced as the engine's were and back to back
        for cache in ("cold", "warm"):
            for paced in (True, False):
                if reads_file(cache).exists():
                    files = shard_files(path)
                    prep = drop_cache(files) if cache == "cold" else warm_cache(files)
                    r = run_child(ours_py, ["--replay", str(reads_file(cache)), "--threads", "8"]
                                  + (["--paced"] if paced else []), T)
                    r["prep"] = prep
                    replay[cache].append(r)

    meta = {"fractions": fractions, "engines": engines, "miss_batch": miss_batch, "tokens": args.tokens,
            "repeat": args.repeat, "runs": args.runs, "seconds": time.perf_counter() - t_all,
            "cpus": os.cpu_count()}
    saved = {"found": {"|".join(map(str, k)): v for k, v in found.items()}, "shipped": shipped, "raw": raw,
             "replay": replay, "loads": loads, "meta": meta}
    if args.json:
        Path(args.json).write_text(json.dumps(saved, indent=1, default=str))
    report(saved)


def report(saved: dict) -> list[str]:
    """The table and the verdict lines from saved measurements (also `--report FILE`)."""
    meta, shipped, raw, loads = saved["meta"], saved["shipped"], saved["raw"], saved["loads"]
    found = {}
    for k, v in saved["found"].items():
        engine, fraction, cache = k.split("|")
        found[(engine, float(fraction), cache)] = v
    fractions, miss_batch = meta["fractions"], meta["miss_batch"]
    engines = [tuple(e) for e in meta["engines"]]
    rows = []
    stock = {c: merge(found[("stock", 1.0, c)]) for c in ("cold", "warm")}
    for c, r in stock.items():
        rows.append({**r, "label": "stock mlx-lm", "resident": "100%"})
    reference = stock["warm"].get("tokens") if "error" not in stock["warm"] else None
    for peer, r in shipped.items():
        if "error" in r:
            r = {**r, "error": f"{r['error']} ({r.get('where', '')})"}
        rows.append({**r, "label": f"{peer} {PEERS[peer][1]} as shipped", "resident": "25%"})
    results: dict = {}
    for fraction in fractions:
        for cache in ("cold", "warm"):
            for engine, variant in engines:
                key = (engine + (f" {variant}" if variant else ""), fraction, cache)
                r = results[key] = merge(found[key])
                label = "ours" if engine == "ours" else f"{engine} {PEERS[engine][1]} (shimmed"
                label += f", {variant})" if variant else ("" if engine == "ours" else ")")
                if engine == "ours" and r.get("policy"):
                    label += f" ({r['policy']}{', packed' if r.get('packed') else ''})"
                rows.append({**r, "label": label, "resident": f"{fraction:.0%} ({r.get('slots', '?')})"})

    print()
    lines = print_table(rows, reference)
    extra = []
    for cache in ("cold", "warm"):
        ours_runs = [run for r in found.get(("ours", fractions[0], cache), []) for run in r.get("runs", [])]
        read_s = sum(run.get("decode_read_seconds") or 0 for run in ours_runs)
        replays = {paced: [r for r in saved.get("replay", {}).get(cache, []) if r.get("mb_s") and r["paced"] == paced]
                   for paced in (True, False)}
        if not read_s or not replays[True]:
            why = "no reads during decode" if not read_s else "no replay of its reads"
            extra.append(f"I/O efficiency ({cache}): n/a ({why})")
            continue
        eng_mb_s = sum(run["decode_bytes"] for run in ours_runs) / read_s / 1e6
        # How much of the decode misses' bytes the disk served (a cold run's prefill reads
        # most of this small checkpoint into the page cache, so most of its misses are cached)
        disk = sum(run.get("disk_mb_tok") or 0 for run in ours_runs) / max(sum(run["mb_tok"] for run in ours_runs), 1e-9)
        paced, back_to_back = (statistics.median(r["mb_s"] for r in replays[k]) if replays[k] else math.nan
                               for k in (True, False))
        ratio = eng_mb_s / paced
        extra.append(f"I/O efficiency ({cache} run, {fractions[0]:.0%} resident, decode misses, {disk:.0%} of their "
                     f"bytes from disk): engine {eng_mb_s:.0f} MB/s (bytes_read / read_seconds) vs raw preadv of the "
                     f"same {replays[True][0]['calls']} read calls from the same cache state, paced as the engine's "
                     f"{paced:.0f} MB/s = {ratio:.2f}x [target >= 0.8: {'PASS' if ratio >= 0.8 else 'FAIL'}]; "
                     f"back to back {back_to_back:.0f} MB/s = {eng_mb_s / back_to_back:.2f}x")
    extra.append(f"raw preadv, every expert once in shuffled batches of {miss_batch}, 8 threads: " + ", ".join(
        f"{c} {statistics.median(r['mb_s'] for r in raw[c] if 'error' not in r):.0f} MB/s"
        for c in ("cold", "warm") if any('error' not in r for r in raw[c])))
    f0 = fractions[0]
    for cache in ("cold", "warm"):
        o = results.get(("ours", f0, cache), {})
        peers_ok = [dict(results.get((p, f0, cache), {}), engine=p)
                    for p in list(PEERS) + ["bigrig slot pool"] if (p, f0, cache) in results]
        peers_ok = [p for p in peers_ok if "error" not in p and p.get("tps")]
        if "error" in o or not o.get("tps") or not peers_ok:
            extra.append(f"target at {f0:.0%} ({cache}): cannot judge (a run failed)")
            continue
        best = max(peers_ok, key=lambda p: p["tps"])
        speed = o["tps"] / best["tps"]
        mb_ok = all(o["mb_tok"] <= p["mb_tok"] + 1e-9 for p in peers_ok)
        toks = reference is not None and all(t == reference for t in o.get("all_tokens", []))
        verdict = "PASS" if speed >= 1.2 and mb_ok and toks else "FAIL"
        extra.append(f"target at {f0:.0%} ({cache}): decode {speed:.2f}x the better peer ({best['engine']}, "
                     f"need >= 1.2x); MB/tok {o['mb_tok']:.2f} vs "
                     + ", ".join(f"{p['engine']} {p['mb_tok']:.2f}" for p in peers_ok)
                     + f" (need <= all); tokens equal stock: {'yes' if toks else 'NO'} -> {verdict}; "
                     f"CPU ms/tok ours {o['cpu_ms_tok']:.0f} vs {best['engine']} {best['cpu_ms_tok']:.0f}")
    shims_used = {p: next((r.get("shims") for (e, _, _), r in results.items() if e == p and r.get("shims")), [])
                  for p in PEERS}
    for p in PEERS:
        s = shipped[p]
        extra.append(f"{p} as shipped: " + (f"{s['error']} at {s.get('where', '?')}" if "error" in s else "ran"))
        if shims_used[p]:
            extra.append(f"{p} shims: " + "; ".join(shims_used[p]))
    if loads:
        extra.append(f"1-min load average on this {meta['cpus']}-core machine around the runs: "
                     f"{min(loads):.1f} to {max(loads):.1f} (other jobs share it: tok/s is noisy, CPU ms/tok less so)")
    extra.append(f"prompt: {len(PROMPT)} tokens ({PROMPT[0]}..{PROMPT[-1]}), {meta['tokens']} tokens greedy, "
                 f"{meta['repeat']} cycle(s); cold = 1 run in a fresh process per cycle, warm = {meta['runs']} runs "
                 f"after 1 warm-up per cycle; medians over the pooled runs; total {meta['seconds']:.0f}s")
    print("\n".join(extra))
    return lines + extra




# -- --large ---------------------------------------------------------------------------

def _st_header(entries: list[tuple[str, str, tuple]]) -> tuple[bytes, dict]:
    """A safetensors header for (name, dtype, shape) in order, data packed back to back."""
    sizes = {"U32": 4, "F32": 4, "F16": 2, "BF16": 2, "U8": 1}
    header, offset = {}, 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "mlx"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, header


def build_large(dest: Path, shape: dict = LARGE_SHAPE, layers_per_shard: int = LARGE_LAYERS_PER_SHARD) -> Path:
    """Write a qwen3_moe checkpoint too big for memory, one tensor chunk at a time.

    The dense weights (attention, norms, embeddings, head), the config and the tokenizer
    come from a factory checkpoint of the same shape with 8 tiny experts; the routers
    are drawn and quantized here (8-bit, as mlx-lm asks for qwen3_moe routers); the
    stacked 4-bit expert tensors are streamed: random codes, and scales/biases that
    dequantize them to uniform weights of std 1/sqrt(fan_in), like the factory's.
    Reused when `large.json` (written last) matches.
    """
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from llm_mlx_streaming.checkpoints.factory import build_checkpoint

    marker = dest / "large.json"
    want = {"version": LARGE_VERSION, "shape": shape, "layers_per_shard": layers_per_shard}
    if marker.exists():
        m = json.loads(marker.read_text())
        if m.get("want") == want and all((dest / f).stat().st_size == s for f, s in m["files"].items()
                                          if (dest / f).exists()) and all((dest / f).exists() for f in m["files"]):
            return dest
    H, I, E, L = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_experts"], shape["num_layers"]
    tmpl = build_checkpoint(CACHE / "qwen3_moe-large-template", "qwen3_moe", quant="4bit", seed=0,
                            hidden_size=H, moe_intermediate_size=64, num_experts=8, top_k=min(8, shape["top_k"]),
                            num_layers=L)
    dest.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    for f in dest.glob("*.safetensors"):
        f.unlink()
    config = json.loads((tmpl / "config.json").read_text())
    config.update(num_experts=E, moe_intermediate_size=I, num_experts_per_tok=shape["top_k"])
    q = config["quantization"]
    bits, group = q["bits"], q["group_size"]
    gate_q = q.get("model.layers.0.mlp.gate", {"bits": 8, "group_size": 64})

    # template tensors (dense), by name
    tmpl_tensors = {}
    for f in sorted(tmpl.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            hdr = json.loads(fh.read(n))
        for name, spec in hdr.items():
            if name != "__metadata__":
                tmpl_tensors[name] = (f, 8 + n + spec["data_offsets"][0], spec)
    dense = {k: v for k, v in tmpl_tensors.items() if ".mlp.gate." not in k and ".mlp.switch_mlp." not in k}

    per = 32 // bits
    projs = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}  # (out, in)
    rng = np.random.default_rng(12345)
    base = rng.integers(0, 2**32, size=(8 << 20,), dtype=np.uint32)  # 32 MiB of codes, reused with xor
    scale_tables = {}
    for p, (o, i) in projs.items():
        s0 = math.sqrt(3.0) / math.sqrt(i) / ((2**bits - 1) / 2)
        scale_tables[p] = (s0 * (1 + 0.1 * (2 * rng.random((8, o, i // group), dtype=np.float32) - 1))).astype(np.float32)

    shards = [list(range(a, min(a + layers_per_shard, L))) for a in range(0, L, layers_per_shard)]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map, files, total = {}, {}, 0
    t0 = time.perf_counter()
    for k, (layers, fname) in enumerate(zip(shards, names)):
        entries = []  # (name, dtype, shape, producer)
        for name, (f, off, spec) in sorted(dense.items()):
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if (m and int(m.group(1)) in layers) or (not m and k == 0):
                entries.append((name, spec["dtype"], tuple(spec["shape"]), ("copy", f, off, spec)))
        for l in layers:
            pre = f"model.layers.{l}.mlp"
            g_per = 32 // gate_q["bits"]
            entries += [(f"{pre}.gate.weight", "U32", (E, H // g_per), ("gate", l, "weight")),
                        (f"{pre}.gate.scales", "F32", (E, H // gate_q["group_size"]), ("gate", l, "scales")),
                        (f"{pre}.gate.biases", "F32", (E, H // gate_q["group_size"]), ("gate", l, "biases"))]
            for p, (o, i) in projs.items():
                entries += [(f"{pre}.switch_mlp.{p}.weight", "U32", (E, o, i // per), ("codes", l, p)),
                            (f"{pre}.switch_mlp.{p}.scales", "F32", (E, o, i // group), ("scales", l, p)),
                            (f"{pre}.switch_mlp.{p}.biases", "F32", (E, o, i // group), ("biases", l, p))]
        head, hdr = _st_header([(n, d, s) for n, d, s, _ in entries])
        gates = {}
        with open(dest / fname, "wb") as out:
            out.write(head)
            for name, dtype, shp, prod in entries:
                kind = prod[0]
                if kind == "copy":
                    _, f, off, spec = prod
                    n = spec["data_offsets"][1] - spec["data_offsets"][0]
                    with open(f, "rb") as src:
                        src.seek(off)
                        out.write(src.read(n))
                elif kind == "gate":
                    _, l, part = prod
                    if l not in gates:
                        g = np.random.default_rng([7, l]).random((E, H), dtype=np.float32)
                        w = mx.array((2 * g - 1) * np.float32(1.0 / math.sqrt(H) * math.sqrt(3.0)))
                        wq, s, b = mx.quantize(w, group_size=gate_q["group_size"], bits=gate_q["bits"])
                        gates[l] = {"weight": np.array(wq), "scales": np.array(s.astype(mx.float32)),
                                    "biases": np.array(b.astype(mx.float32))}
                    arr = gates[l][part]
                    assert arr.shape == shp, (name, arr.shape, shp)
                    out.write(arr.tobytes())
                else:
                    _, l, p = prod
                    per_expert = math.prod(shp[1:])
                    chunk = max(1, (8 << 20) // per_expert)
                    for e0 in range(0, E, chunk):
                        ne = min(chunk, E - e0)
                        if kind == "codes":
                            n = ne * per_expert
                            salt = np.uint32((l * 1000003 + e0 * 7919 + hash(p) % 65521) & 0xFFFFFFFF)
                            out.write((base[:n] ^ salt).tobytes())
                        else:
                            tab = scale_tables[p]
                            s = tab[(np.arange(e0, e0 + ne) + l) % len(tab)]
                            if kind == "biases":
                                s = s * np.float32(-(2**bits - 1) / 2)
                            out.write(np.ascontiguousarray(s).tobytes())
            out.flush()
            os.fsync(out.fileno())
        size = (dest / fname).stat().st_size
        assert size == len(head) + max(v["data_offsets"][1] for k2, v in hdr.items() if k2 != "__metadata__")
        files[fname] = size
        total += size
        for name, *_ in entries:
            weight_map[name] = fname
        el = time.perf_counter() - t0
        print(f"  wrote {fname} ({size / 1e9:.2f} GB), {total / 1e9:.1f} GB in {el:.0f}s "
              f"({total / el / 1e6:.0f} MB/s)", flush=True)
        # what was just written need not stay in the page cache
        fd = os.open(dest / fname, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    (dest / "config.json").write_text(json.dumps(config, indent=4))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmpl / f, dest / f)
    (dest / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    marker.write_text(json.dumps({"want": want, "files": files}, indent=1))
    return dest


def measure_write_speed(directory: Path, gib: float = 1.0) -> float:
    """MB/s writing `gib` GiB of incompressible data, fsync included."""
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    f = directory / "write-test.bin"
    block = np.random.default_rng(0).integers(0, 2**32, size=(32 << 20) // 4, dtype=np.uint32)
    n = int(gib * 32)
    t = time.perf_counter()
    with open(f, "wb") as out:
        for i in range(n):
            out.write((block ^ np.uint32(i)).tobytes())
        out.flush()
        os.fsync(out.fileno())
    dt = time.perf_counter() - t
    f.unlink()
    return n * (32 << 20) / dt / 1e6


def large_main(args) -> None:
    t_all = time.perf_counter()
    H, I, E, L = (LARGE_SHAPE[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts", "num_layers"))
    per_expert = 3 * I * H // 2 + 3 * 2 * (I * H // 64) * 4  # 4-bit codes + f32 scales/biases, group 64
    expert_bytes = L * E * per_expert
    dest = CACHE / "qwen3_moe-large"
    mem = _meminfo_bytes("MemTotal")
    print(f"--large: {L} layers x {E} experts x {per_expert / 1e6:.2f} MB = {expert_bytes / 1e9:.1f} GB of experts "
          f"({expert_bytes / 2**30:.1f} GiB; this machine has {mem / 2**30:.1f} GiB of memory, "
          f"swap {_meminfo_bytes('SwapTotal') / 2**30:.1f} GiB)", flush=True)
    built = (dest / "large.json").exists()
    if not built:
        free = shutil.disk_usage(CACHE).free
        speed = measure_write_speed(CACHE, 1.0)
        eta = expert_bytes / speed / 1e6
        print(f"disk: {free / 1e9:.0f} GB free; write speed {speed:.0f} MB/s (1 GiB, fsync) -> "
              f"build estimate {eta / 60:.1f} min", flush=True)
        if free < 60e9 or free < expert_bytes * 1.3:
            print("not building: less than 60 GB free on this disk")
            return
        if eta > args.max_build_minutes * 60 and not args.force_build:
            print(f"not building: the estimate exceeds {args.max_build_minutes} min "
                  "(--force-build to build anyway; --large-dry-run to check the writer at small scale)")
            return
    if args.large_dry_run:
        small = dict(LARGE_SHAPE, num_layers=4, num_experts=32)
        dest = CACHE / "qwen3_moe-large-dry"
        print(f"dry run: {small}", flush=True)
        t = time.perf_counter()
        build_large(dest, small, layers_per_shard=2)
        print(f"built {dest} in {time.perf_counter() - t:.0f}s", flush=True)
    else:
        t = time.perf_counter()
        build_large(dest)
        print(f"checkpoint {dest} ready in {time.perf_counter() - t:.0f}s", flush=True)
    files = shard_files(dest)
    limit = int(args.large_limit_gb * 2**30)
    print(f"each run: a subprocess under RLIMIT_AS = {limit / 2**30:.0f} GiB, checkpoint dropped from the "
          f"page cache first, {args.tokens} tokens greedy", flush=True)
    rows = []
    stock = None
    for engine, fraction in [("stock", 1.0)] + [("ours", float(f)) for f in args.large_fractions.split(",")]:
        prep = drop_cache(files)
        t = time.perf_counter()
        r = summarise(run_child(sys.executable, child_argv(engine, dest, fraction, args.tokens, 1, 0),
                                args.timeout, as_limit=limit))
        r.update(cache="cold", prep=prep, engine=engine)
        print(f"  {engine} {fraction:.0%}: " + (r["error"] if "error" in r else f"{r['tps']:.2f} tok/s")
              + f" [{time.perf_counter() - t:.0f}s, peak RSS {r['peak_rss'] / 1e9:.2f} GB]", flush=True)
        if engine == "stock":
            stock = r
        label = "stock mlx-lm" if engine == "stock" else f"ours ({r.get('policy') or '?'})"
        rows.append({**r, "label": label, "resident": f"{fraction:.0%}" + (f" ({r.get('slots')})" if engine != "stock" else "")})
    print()
    ref = stock.get("tokens") if stock and "error" not in stock else None
    lines = print_table(rows, ref)
    if stock and "error" in stock:
        print(f"stock mlx-lm under RLIMIT_AS {limit / 2**30:.0f} GiB: {stock['error']} after {stock['wall']:.0f}s "
              f"at {stock.get('where') or '?'} (exit code {stock.get('rc')}), peak RSS {stock['peak_rss'] / 1e9:.1f} GB. "
              f"Unlimited it would need the whole {expert_bytes / 1e9:.1f} GB in {mem / 2**30:.1f} GiB of memory "
              f"with {_meminfo_bytes('SwapTotal') / 2**30:.0f} GiB of swap: no swapping possible, the OOM killer instead.")
        for line in stock.get("stderr_tail", [])[-4:]:
            print("    " + line)
    ours = [r for r in rows if r.get("engine") == "ours" and "error" not in r]
    if len(ours) > 1:
        same = all(r["tokens"] == ours[0]["tokens"] for r in ours)
        print(f"our tokens at {', '.join(r['resident'] for r in ours)} resident: "
              f"{'identical' if same else 'DIFFERENT'} ({len(ours[0]['tokens'])} tokens)")
    print(f"total {time.perf_counter() - t_all:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "lines": lines}, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per run (64; --large: 16)")
    parser.add_argument("--runs", type=int, default=2, help="measured warm runs per child (after 1 warm-up)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="cycles over every row, interleaved; runs of all cycles pooled (median)")
    parser.add_argument("--fractions", default="0.25,0.5", help="shares of experts resident")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per child (900; --large: 3600)")
    parser.add_argument("--no-shims", action="store_true", help="run the peers only as shipped")
    parser.add_argument("--no-pack", action="store_true",
                        help="no packed copies: every engine reads the safetensors (remove existing ones first)")
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--report", metavar="JSON", help="print the table again from a --json file")
    parser.add_argument("--large", action="store_true", help="the bigger-than-memory checkpoint")
    parser.add_argument("--large-limit-gb", type=float, default=16.0, help="RLIMIT_AS of each --large run (GiB)")
    parser.add_argument("--large-fractions", default="0.1,0.25")
    parser.add_argument("--large-dry-run", action="store_true", help="build and run a small one instead")
    parser.add_argument("--max-build-minutes", type=float, default=20.0)
    parser.add_argument("--force-build", action="store_true")
    # internal: the child processes
    parser.add_argument("--child", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replay", help=argparse.SUPPRESS)
    parser.add_argument("--reads", help=argparse.SUPPRESS)
    parser.add_argument("--paced", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pack-bigrig", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, default=0.25, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--prompt", default=",".join(map(str, PROMPT)), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--limit-experts", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--source", default="safetensors", choices=("safetensors", "packed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 16 if args.large else 64
    if args.timeout is None:
        args.timeout = 3600.0 if args.large else 900.0
    if args.child:
        child_main(args)
    elif args.raw:
        raw_main(args)
    elif args.replay:
        replay_main(args)
    elif args.pack_bigrig:
        pack_bigrig_main(args)
    elif args.report:
        report(json.loads(Path(args.report).read_text()))
    elif args.large:
        large_main(args)
    else:
        normal_main(args)


if __name__ == "__main__":
    main()
