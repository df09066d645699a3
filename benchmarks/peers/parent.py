"""Parent side (the project's venv): the peers' venv, packed copies, the page cache, the
child processes, and the normal run over every engine."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .common import BIGRIG_HOME, CACHE, ENTRY, MARK, PEERS, PEERS_VENV, PROMPT, ROOT, SHAPE
from .cgroup import CgroupError, MemoryCgroup
from .engines import OURS_VARIANTS, VARIANTS
from .report import report


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
    from llm_mlx_streaming.checkpoints.packing import pack_checkpoint
    from llm_mlx_streaming.experts.packed import INDEX_NAME, packed_dir

    if not (packed_dir(path) / INDEX_NAME).exists():  # a stale one: the engine says so and the table shows it
        t = time.perf_counter()
        pack_checkpoint(path)
        print(f"packed ours in {time.perf_counter() - t:.1f}s", flush=True)
    if not bigrig_blob(path).exists():
        t = time.perf_counter()
        subprocess.run([peers_py, str(ENTRY), "--pack-bigrig", "--path", str(path)],
                       check=True, env={**os.environ, "BIGRIG_HOME": str(BIGRIG_HOME)}, capture_output=True)
        print(f"packed BigRig's blob in {time.perf_counter() - t:.1f}s", flush=True)


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
              as_limit: int | None = None, cgroup=None) -> dict:
    """Run one child (inside `cgroup`, a MemoryCgroup, when given); its @@RESULT line,
    or a row saying why there is none."""
    def limit():
        if as_limit:
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
        if cgroup is not None:
            cgroup.enter()

    cmd = [python, str(ENTRY)] + argv
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
        why = f"killed by signal {-proc.returncode}" + (" (the memory limit)" if cgroup else "") + f"; {why}"
    return {"error": why, "rc": proc.returncode, "wall": elapsed, "peak_rss": hwm[0],
            "stderr_tail": err.strip().splitlines()[-15:]}


def child_argv(engine: str, path: Path, fraction: float, tokens: int, runs: int, warmup: int,
               shims: bool = True, variant: str = "") -> list[str]:
    argv = ["--child", engine, "--path", str(path), "--fraction", str(fraction), "--tokens", str(tokens),
            "--runs", str(runs), "--warmup", str(warmup), "--prompt", ",".join(map(str, PROMPT))]
    return argv + ([] if shims else ["--no-shims"]) + OURS_VARIANTS.get(variant, [])


def normal_main(args) -> None:
    sys.path.insert(0, str(ROOT))
    from fixtures.factory import build_checkpoint
    from llm_mlx_streaming.experts.index import CheckpointIndex

    t_all = time.perf_counter()
    path = build_checkpoint(CACHE / "qwen3_moe-bench", "qwen3_moe", quant="4bit", seed=0, **SHAPE)
    index = CheckpointIndex(path)
    expert_mb = sum(t.nbytes for k, t in index.tensors.items() if "switch_mlp" in k) / 1e6
    files = shard_files(path)
    print(f"checkpoint {path} ({expert_mb:.0f} MB of experts)", flush=True)
    cgroup = None
    if args.iobound:
        try:
            cgroup = MemoryCgroup(int(args.iobound * 1e6))
        except CgroupError as e:
            raise SystemExit(str(e)) from None
        print(f"I/O-bound: every child but stock mlx-lm (the reference tokens) runs in a {cgroup.describe()}, "
              f"below the {expert_mb:.0f} MB of experts; the page cache is emptied before each "
              "(warm = a warm-up generation in the same process)", flush=True)
    try:
        _grid(args, path, files, cgroup, t_all)
    finally:
        if cgroup is not None:
            cgroup.close()


def _grid(args, path: Path, files: list[Path], cgroup, t_all: float) -> None:
    """Every engine at every residency, cold and warm, then the raw reads and replays."""
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
        prep = drop_cache(files) if cache == "cold" or cgroup else warm_cache(files)
        runs, warmup = (1, 0) if cache == "cold" else (args.runs, 1)
        t = time.perf_counter()
        load0 = os.getloadavg()[0]
        argv = child_argv(engine, path, fraction, args.tokens, runs, warmup, shims, variant)
        if engine == "ours" and variant == io_variant and fraction == fractions[0]:  # for the replay
            argv += ["--reads", str(reads_file(cache))]
        # stock holds the whole model, more than an I/O-bound limit: it runs unlimited,
        # for the reference tokens
        res = run_child(py, argv, T, {**env, **VARIANTS.get(variant, {})},
                        cgroup=None if engine == "stock" else cgroup)
        res.update(cache=cache, prep=prep, engine=engine, fraction=fraction, variant=variant,
                   loadavg=(load0, os.getloadavg()[0]))
        loads.extend(res["loadavg"])
        tps = [f"{r['tps']:.2f}" for r in res.get("runs", [])]
        print(f"  {engine + (' ' + variant if variant else ''):<17} {fraction:>5.0%} {cache:<4} ({prep}): "
              + (f"{', '.join(tps)} tok/s" if "error" not in res else res["error"])
              + f"  [{time.perf_counter() - t:.0f}s, load {load0:.1f}]", flush=True)
        log.append(res)
        return res

    # The read path is judged on reads no read-ahead competes with: I/O-bound, "overlap off".
    io_variant = "overlap off" if cgroup else ""
    io_row = "ours" + (f" {io_variant}" if io_variant else "")
    ours = [("ours", ""), ("ours", "overlap off")] + ([("ours", "overlap on"), ("ours", "bypass")] if cgroup else [])
    engines = ours + ([] if args.no_shims else [(p, "") for p in PEERS] + [("bigrig", "slot pool")])
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
            prep = drop_cache(files) if cache == "cold" or cgroup else warm_cache(files)
            r = run_child(ours_py, ["--raw", "--path", str(path), "--batch", str(miss_batch),
                                    "--threads", "8", "--source", source], T, cgroup=cgroup)
            r["prep"] = prep
            raw[cache].append(r)
        # 5. raw preadv of exactly our decode reads, from the cache state our run started in,
        #    paced as the engine's were and back to back
        for cache in ("cold", "warm"):
            for paced in (True, False):
                if reads_file(cache).exists():
                    files = shard_files(path)
                    prep = drop_cache(files) if cache == "cold" or cgroup else warm_cache(files)
                    # in a cgroup, the engine's own memory left the page cache less room
                    engine_rss = found.get((io_row, fractions[0], cache), [{}])[-1].get("peak_rss") or 0
                    r = run_child(ours_py, ["--replay", str(reads_file(cache)), "--threads", "8"]
                                  + (["--paced"] if paced else [])
                                  + (["--ballast", str(engine_rss)] if cgroup else []), T, cgroup=cgroup)
                    r["prep"] = prep
                    replay[cache].append(r)

    meta = {"fractions": fractions, "engines": engines, "miss_batch": miss_batch, "tokens": args.tokens,
            "repeat": args.repeat, "runs": args.runs, "seconds": time.perf_counter() - t_all,
            "cpus": os.cpu_count(), "iobound_mb": args.iobound,
            "io_row": io_row}
    saved = {"found": {"|".join(map(str, k)): v for k, v in found.items()}, "shipped": shipped, "raw": raw,
             "replay": replay, "loads": loads, "meta": meta}
    if args.json:
        Path(args.json).write_text(json.dumps(saved, indent=1, default=str))
    report(saved)
