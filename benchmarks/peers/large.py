"""--large: a checkpoint bigger than memory, written by a streaming writer (the factory
holds a whole model in memory), and stock mlx-lm and ours run under one RLIMIT_AS."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
import time
from pathlib import Path

from .common import CACHE, LARGE_LAYERS_PER_SHARD, LARGE_SHAPE, LARGE_VERSION, ROOT, meminfo_bytes
from .parent import child_argv, drop_cache, run_child, shard_files
from .report import print_table, summarise


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
    from fixtures.factory import build_checkpoint

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
    mem = meminfo_bytes("MemTotal")
    print(f"--large: {L} layers x {E} experts x {per_expert / 1e6:.2f} MB = {expert_bytes / 1e9:.1f} GB of experts "
          f"({expert_bytes / 2**30:.1f} GiB; this machine has {mem / 2**30:.1f} GiB of memory, "
          f"swap {meminfo_bytes('SwapTotal') / 2**30:.1f} GiB)", flush=True)
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
    # ours as it ships (overlap auto) and with the read path before the overlap (off)
    runs = [("stock", 1.0, "")] + [("ours", float(f), variant) for f in args.large_fractions.split(",")
                                   for variant in ("", "overlap off")]
    for engine, fraction, variant in runs:
        prep = drop_cache(files)
        t = time.perf_counter()
        r = summarise(run_child(sys.executable, child_argv(engine, dest, fraction, args.tokens, 1, 0, variant=variant),
                                args.timeout, as_limit=limit))
        r.update(cache="cold", prep=prep, engine=engine, variant=variant)
        name = engine + (f" {variant}" if variant else "")
        print(f"  {name} {fraction:.0%}: " + (r["error"] if "error" in r else f"{r['tps']:.2f} tok/s")
              + f" [{time.perf_counter() - t:.0f}s, peak RSS {r['peak_rss'] / 1e9:.2f} GB]", flush=True)
        if engine == "stock":
            stock = r
        label = "stock mlx-lm" if engine == "stock" else f"ours ({r.get('policy') or '?'}, {variant or 'overlap auto'})"
        rows.append({**r, "label": label, "resident": f"{fraction:.0%}" + (f" ({r.get('slots')})" if engine != "stock" else "")})
    print()
    ref = stock.get("tokens") if stock and "error" not in stock else None
    lines = print_table(rows, ref)
    if stock and "error" in stock:
        print(f"stock mlx-lm under RLIMIT_AS {limit / 2**30:.0f} GiB: {stock['error']} after {stock['wall']:.0f}s "
              f"at {stock.get('where') or '?'} (exit code {stock.get('rc')}), peak RSS {stock['peak_rss'] / 1e9:.1f} GB. "
              f"Unlimited it would need the whole {expert_bytes / 1e9:.1f} GB in {mem / 2**30:.1f} GiB of memory "
              f"with {meminfo_bytes('SwapTotal') / 2**30:.0f} GiB of swap: no swapping possible, the OOM killer instead.")
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
