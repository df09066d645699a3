"""Child side: each engine behind one interface, run in the peers' venv (bigrig, boyle)
or the project's (stock, ours). Imports nothing from this repository unless it is ours."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from .common import MARK, PEERS, ROOT, peak_rss, proc_io, where
from .shims import shim_bigrig, shim_boyle


class Stock:
    name = "stock"

    def __init__(self, path: str, fraction: float, shims: bool):
        from mlx_lm import load

        self.model, self.tokenizer = load(path)

    def generate(self, prompt, max_tokens):
        from mlx_lm import stream_generate

        return stream_generate(self.model, self.tokenizer, prompt, max_tokens=max_tokens)

    def counters(self):
        return None


class Ours:
    name = "ours"

    def __init__(self, path: str, fraction: float, shims: bool, overlap: str = "auto", page_cache: str = "keep"):
        sys.path.insert(0, str(ROOT))
        from llm_mlx_streaming.engine.manager import EngineManager
        from llm_mlx_streaming.engine.request import Request

        self._request = Request

        config = json.loads((Path(path) / "config.json").read_text())
        self.slots = max(1, round(config["num_experts"] * fraction))
        self.engine = EngineManager()
        # the engine's default policy
        self.engine.load(path, expert_slots=self.slots, overlap=overlap, page_cache=page_cache)
        self.policy = self.engine.running.policy
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
        self.engine.prompts.reset()  # no KV reuse between runs: every run prefills
        self._phase = {"run": self._phase["run"] + 1, "phase": "prefill"}
        for r in self.engine.run(None, self._request(prompt=list(prompt), max_tokens=max_tokens)):
            yield r
            self._phase["phase"] = "decode"  # what follows the first token

    def counters(self):
        c = self.engine.counters()
        return {"hits": c.hits, "misses": c.misses, "bytes": c.bytes_read, "read_seconds": c.read_seconds,
                "overlapped": c.overlapped, "prefetch_loads": c.prefetch_loads, "prefetch_hits": c.prefetch_hits}


class BigRig:
    name = "bigrig"

    def __init__(self, path: str, fraction: float, shims: bool):
        self.shims = shim_bigrig() if shims else []
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


class Boyle:
    name = "boyle"

    def __init__(self, path: str, fraction: float, shims: bool):
        self.shims = shim_boyle() if shims else []
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


ENGINES = {"stock": Stock, "ours": Ours, "bigrig": BigRig, "boyle": Boyle}
# BigRig's default runs experts from the file's mmapped pages (its "file pool": the page
# cache is its pool, and its RSS counts those pages); its slot pool copies experts into
# slots, as ours and boyle's do. Both are measured; they are BigRig's own switches.
VARIANTS = {"slot pool": {"BIGRIG_VIEWS_PREFILL": "0", "BIGRIG_VIEWS_DECODE": "0"}}
# Ours with the overlap forced either way (the plain row is the default, `auto`).
OURS_VARIANTS = {"overlap on": ["--overlap", "on"], "overlap off": ["--overlap", "off"],
                 "bypass": ["--page-cache", "bypass"]}


def one_run(eng, prompt: list[int], tokens: int) -> dict:
    import mlx.core as mx

    def cpu():
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    mx.reset_peak_memory()
    c0, io0 = eng.counters(), proc_io()
    start = time.perf_counter()
    ttft, c1, io1, cpu1, out, last = None, None, None, None, [], None
    for r in eng.generate(prompt, tokens):
        if ttft is None:
            ttft = time.perf_counter() - start
            c1, io1, cpu1 = eng.counters(), proc_io(), cpu()  # prefill done: what follows is decode
        out.append(int(r.token))
        last = r
    c2, io2, cpu2 = eng.counters(), proc_io(), cpu()
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
        for k in ("overlapped", "prefetch_loads", "prefetch_hits"):
            if k in c2:
                res[k] = c2[k] - c1[k]
    return res


def child_main(args) -> None:
    result: dict = {"engine": args.child, "fraction": args.fraction}
    package = PEERS[args.child][2] if args.child in PEERS else None
    try:
        t = time.perf_counter()
        own = {"overlap": args.overlap, "page_cache": args.page_cache} if args.child == "ours" else {}
        eng = ENGINES[args.child](args.path, args.fraction, not args.no_shims, **own)
        result["load_seconds"] = time.perf_counter() - t
        result["slots"] = getattr(eng, "slots", None)
        result["shims"] = getattr(eng, "shims", [])
        result["policy"] = getattr(eng, "policy", None)
        result["packed"] = getattr(eng, "packed", None)
        prompt = [int(x) for x in args.prompt.split(",")]
        for _ in range(args.warmup):
            one_run(eng, prompt, args.tokens)
        result["runs"] = [one_run(eng, prompt, args.tokens) for _ in range(args.runs)]
        if args.reads and hasattr(eng, "reads"):
            Path(args.reads).write_text(json.dumps({"warmup": args.warmup, "calls": eng.reads}))
    except BaseException as e:  # noqa: BLE001 -- reported in the table, not raised
        result["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        result["where"] = where(e, package)
    result["peak_rss"] = peak_rss()
    print(MARK + json.dumps(result), flush=True)


def pack_bigrig_main(args) -> None:
    """Child side of pack_all, in the peers venv."""
    shim_bigrig()
    from bigrig_engine import stream

    stream.ensure_packed(args.path, "", verbose=False)
