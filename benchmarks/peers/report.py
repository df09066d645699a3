"""The table and the verdict lines, from fresh or saved measurements."""

from __future__ import annotations

import math
import statistics

from .common import PEERS, PROMPT


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


def disk_share(r: dict) -> float | None:
    """Share of the decode misses' bytes that storage served (/proc/self/io read_bytes
    over the engine's own count): what proves a run I/O-bound rather than assumes it."""
    if r.get("disk_mb_tok") is None or not r.get("mb_tok"):
        return None
    return r["disk_mb_tok"] / r["mb_tok"]


def print_table(rows: list[dict], reference: list[int] | None, ref_name: str = "stock") -> list[str]:
    head = (f"{'engine':<34} {'resident':>9} {'cache':>5} {'decode tok/s':>12} {'CPU ms/tok':>10} {'TTFT s':>7} "
            f"{'load s':>6} {'engine MB/tok':>13} {'disk MB/tok':>11} {'from disk':>9} {'hit rate':>8} "
            f"{'peak RSS MB':>11}  tokens = {ref_name}")
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
        if r["cache"] == "warm" and (r.get("disk_mb_tok") or 0) > 1 and not r.get("iobound"):
            disk += "*"  # the page cache was emptied under the run (the cache folder is shared)
        lines.append(
            f"{label:<34} {resident:>9} {r['cache']:>5} {r['tps']:>12.2f} {fmt(r.get('cpu_ms_tok'), '10.0f'):>10} "
            f"{r['ttft']:>7.2f} {fmt(r.get('load_seconds'), '6.1f'):>6} {fmt(r.get('mb_tok'), '13.2f'):>13} "
            f"{disk:>11} {fmt(disk_share(r), '9.0%'):>9} {fmt(r.get('hit_rate'), '8.3f'):>8} "
            f"{r['peak_rss'] / 1e6:>11.0f}  {same}")
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
        rows.append({**r, "label": "stock mlx-lm" + (" (no memory limit)" if meta.get("iobound_mb") else ""),
                     "resident": "100%"})
    reference, ref_name = (stock["warm"].get("tokens"), "stock") if "error" not in stock["warm"] else (None, "stock")
    iobound = meta.get("iobound_mb")
    if reference is None and iobound:  # stock holds the whole model: more than the limit
        ours_warm = merge(found.get(("ours", fractions[0], "warm"), [{"error": "missing"}]))
        reference, ref_name = ours_warm.get("tokens"), "ours warm"
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
                if engine == "ours":
                    label = "ours" + (f" ({r['policy']}{', packed' if r.get('packed') else ''}" if r.get("policy")
                                      else " (") + f", {variant or 'overlap auto'})"
                else:
                    label = f"{engine} {PEERS[engine][1]} (shimmed" + (f", {variant})" if variant else ")")
                rows.append({**r, "label": label, "resident": f"{fraction:.0%} ({r.get('slots', '?')})",
                             "iobound": iobound})

    print()
    lines = print_table(rows, reference, ref_name)
    extra = []
    for cache in ("cold", "warm"):
        io_row = meta.get("io_row", "ours")
        ours_runs = [run for r in found.get((io_row, fractions[0], cache), []) for run in r.get("runs", [])]
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
        need = 0.9 if iobound else 0.8
        shares = [r["disk_share"] for r in replays[True] if r.get("disk_share") is not None]
        replay_disk = f", {statistics.median(shares):.0%} from disk" if shares else ""
        ballast = " with the engine's peak RSS held" if any(r.get("ballast") for r in replays[True]) else ""
        extra.append(f"I/O efficiency ({cache} run of {io_row}, {fractions[0]:.0%} resident, decode misses, {disk:.0%} of their "
                     f"bytes from disk): engine {eng_mb_s:.0f} MB/s (bytes_read / read_seconds) vs raw preadv of the "
                     f"same {replays[True][0]['calls']} read calls from the same cache state{ballast}, paced as the "
                     f"engine's {paced:.0f} MB/s{replay_disk} = {ratio:.2f}x [target >= {need}: {'PASS' if ratio >= need else 'FAIL'}]; "
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
        need = 2.0 if iobound else 1.2
        disk = disk_share(o) or 0.0
        # I/O-bound, reading ahead trades bytes for time: MB/tok is shown, not judged
        verdict = "PASS" if speed >= need and (mb_ok or iobound) and toks and (not iobound or disk >= 0.85) else "FAIL"
        extra.append(f"target at {f0:.0%} ({cache}): decode {speed:.2f}x the better peer ({best['engine']}, "
                     f"need >= {need}x)" + (f"; {disk:.0%} of miss bytes from disk (need >= 85%)" if iobound else "")
                     + f"; MB/tok {o['mb_tok']:.2f} vs "
                     + ", ".join(f"{p['engine']} {p['mb_tok']:.2f}" for p in peers_ok)
                     + f" ({'not judged I/O-bound' if iobound else 'need <= all'}); tokens equal {ref_name}: {'yes' if toks else 'NO'} -> {verdict}; "
                     f"CPU ms/tok ours {o['cpu_ms_tok']:.0f} vs {best['engine']} {best['cpu_ms_tok']:.0f}")
    for cache in ("cold", "warm"):
        ours_rows = [(v or "overlap auto", results.get(("ours" + (f" {v}" if v else ""), f0, cache), {}))
                     for e, v in engines if e == "ours"]
        ours_rows = [(v, r) for v, r in ours_rows if r.get("tps")]
        if len(ours_rows) > 1:
            extra.append(f"ours by overlap ({cache}): " + "; ".join(
                f"{v} {r['tps']:.2f} tok/s, {r.get('prefetch_loads', 0) / max(len(r.get('tokens') or [1]) - 1, 1):.1f} "
                f"experts read ahead/tok ({r.get('prefetch_hits', 0) / max(r.get('prefetch_loads') or 1, 1):.0%} used), "
                f"{r.get('overlapped', 0)} calls overlapped" for v, r in ours_rows))
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
