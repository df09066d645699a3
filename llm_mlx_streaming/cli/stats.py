"""`llm mlxs stats`: engine figures read back from llm's logs.db.

A new `llm` process has no engine in memory; the figures were stored per response
(`response_json`) when it ran.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import click
import llm

from ..options import registry

from .group import mlxs
from ..sizes import format_size
from .common import slots_text, table
from ..client.client import running_server
from .plot import check_path, plot_live, plot_logged


def _logged(db_path: Path, limit: int) -> list[dict]:
    if not db_path.exists():
        return []
    try:
        conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise click.ClickException(f"Cannot read {db_path}: {exc}") from None
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute(
            """select id, model, resolved_model, input_tokens, output_tokens,
                      duration_ms, datetime_utc, response_json
               from turns where model = ? or model like ?
               order by datetime_utc desc, id desc limit ?""",
            [registry.MODEL_PREFIX, registry.MODEL_PREFIX + "/%", limit],
        ).fetchall()
    except sqlite3.Error as exc:
        if "no such table" in str(exc):  # llm has not logged anything here yet
            return []
        raise click.ClickException(f"Cannot read {db_path} as llm's log database: {exc}") from None
    finally:
        conn.close()
    out = []
    for row in rows:
        item = dict(row)
        try:
            stats = json.loads(item.pop("response_json") or "{}")
        except json.JSONDecodeError:
            stats = {}
        item["stats"] = _renamed(stats) if isinstance(stats, dict) else {}
        out.append(item)
    return out


# Figures logged under an earlier name (rows written before the rename keep them).
OLD_NAMES = {"gpu_fastpath": "calls_no_load", "gpu_fallback": "calls_loaded"}


def _renamed(stats: dict) -> dict:
    return {OLD_NAMES.get(k, k) if OLD_NAMES.get(k) not in stats else k: v for k, v in stats.items()}


def _num(stats: dict, key: str) -> float:
    value = stats.get(key)
    return value if isinstance(value, (int, float)) else 0


def aggregate(rows: list[dict]) -> dict:
    """Totals over responses: rates are ratios of sums, not means of ratios."""
    s = [r["stats"] for r in rows]
    total = lambda k: sum(_num(x, k) for x in s)  # noqa: E731
    decode_seconds = sum(
        _num(x, "generated_tokens") / x["decode_tps"] for x in s if _num(x, "decode_tps")
    )
    prefill_seconds = sum(
        _num(x, "prefilled_tokens") / x["prefill_tps"] for x in s if _num(x, "prefill_tps")
    )
    lookups = total("hits") + total("misses")
    generated = total("generated_tokens")
    return {
        "responses": len(rows),
        "prompt_tokens": total("prompt_tokens"),
        "reused_tokens": total("reused_tokens"),
        "reused_from": {source: sum(_num(x, "reused_tokens") for x in s if x.get("reused_from") == source)
                        for source in ("memory", "snapshot", "disk")},
        "reuse_note": next((x["reuse_note"] for x in reversed(s) if x.get("reuse_note")), None),
        "prefilled_tokens": total("prefilled_tokens"),
        "generated_tokens": generated,
        "prefill_tps": round(total("prefilled_tokens") / prefill_seconds, 2) if prefill_seconds else None,
        "decode_tps": round(generated / decode_seconds, 2) if decode_seconds else None,
        "hits": total("hits"),
        "misses": total("misses"),
        "hit_rate": round(total("hits") / lookups, 4) if lookups else None,
        "evictions": total("evictions"),
        "mb_read": round(total("mb_read"), 3),
        "mb_read_per_token": round(total("mb_read") / generated, 3) if generated else None,
        "read_seconds": round(total("read_seconds"), 4),
        "read_mb_per_s": round(total("mb_read") / total("read_seconds"), 1) if total("read_seconds") else None,
        "unplaced": total("unplaced"),
        "calls_no_load": total("calls_no_load"),
        "calls_loaded": total("calls_loaded"),
        "overlapped": total("overlapped"),
        "prefetch_loads": total("prefetch_loads"),
        "prefetch_hits": total("prefetch_hits"),
        "syncs": round(total("syncs"), 3),
        "syncs_per_token": round(total("syncs") / generated, 3) if generated else None,
        "peak_memory_bytes": max((_num(x, "peak_memory_bytes") for x in s), default=0),
        **_prefill_totals(s, total),
        **_long_context_totals(s),
        **_speculation_totals(s, total),
    }


def _prefill_totals(s: list[dict], total) -> dict:
    """What the prompts' prefills read: MB in all and per prefilled token, and the mean
    of their passes over the experts (engine/prefill.py)."""
    passes = [x["expert_passes"] for x in s if isinstance(x.get("expert_passes"), (int, float))]
    if not passes:
        return {}
    prefilled = total("prefilled_tokens")
    return {"prefill_mb_read": round(total("prefill_mb_read"), 3),
            "prefill_read_seconds": round(total("prefill_read_seconds"), 4),
            "expert_passes": round(sum(passes) / len(passes), 3)}


# -- long context (engine/kv.py) -------------------------------------------------------


def _long_context_totals(s: list[dict]) -> dict:
    """The largest KV cache and the mean time to first token over the responses."""
    ttfts = [x["ttft_seconds"] for x in s if isinstance(x.get("ttft_seconds"), (int, float))]
    kv = [x["kv_bytes"] for x in s if isinstance(x.get("kv_bytes"), (int, float))]
    out = {}
    if kv:
        out["kv_bytes"] = max(kv)
    if ttfts:
        out["ttft_seconds"] = round(sum(ttfts) / len(ttfts), 4)
    return out


def _long_context_lines(st: dict) -> list[list[str]]:
    lines = []
    if isinstance(st.get("kv_bytes"), (int, float)):
        bits = st.get("kv_bits")
        layout = f"{bits}-bit" if isinstance(bits, int) else "full precision"
        if isinstance(bits, int) and st.get("kv_group_size"):
            layout += f", groups of {st['kv_group_size']}"
        text = f"{format_size(st['kv_bytes'])} ({layout})" if "kv_bits" in st else format_size(st["kv_bytes"])
        if isinstance(st.get("kv_note"), str):
            text += f"; {st['kv_note']}"
        lines.append(["KV cache", text])
    if isinstance(st.get("ttft_seconds"), (int, float)):
        step = st.get("prefill_step")
        lines.append(["first token", f"{st['ttft_seconds']} s" + (f" (prefill calls of up to {step} tokens)" if step else "")])
    return lines


# -- speculation -------------------------------------------------------
def _speculation_totals(s: list[dict], total) -> dict:
    drafted, passes = total("draft_tokens"), total("verify_passes")
    return {
        "draft_tokens": drafted,
        "accepted_tokens": total("accepted_tokens"),
        "acceptance_rate": round(total("accepted_tokens") / drafted, 4) if drafted else None,
        "verify_passes": passes,
        "tokens_per_pass": round(sum(_num(x, "tokens_per_pass") * _num(x, "verify_passes") for x in s) / passes, 3)
        if passes else None,
    }


def _speculation_line(st: dict) -> list[str] | None:
    """"k 3 (ngram): 12 of 30 drafts accepted (40.0%), 1.8 tokens per pass"."""
    if "draft_tokens" not in st:
        return None
    head = f"k {st['k']} ({st.get('draft')})" if "k" in st else "totals"
    if st.get("k") == 0:
        return ["speculation", "off (k 0)"]
    text = f"{head}: {st['accepted_tokens']} of {st['draft_tokens']} drafts accepted"
    if isinstance(st.get("acceptance_rate"), (int, float)):
        text += f" ({st['acceptance_rate'] * 100:.1f}%)"
    if isinstance(st.get("tokens_per_pass"), (int, float)):
        text += f", {st['tokens_per_pass']} tokens per pass"
    if st.get("speculation_off"):
        text += f"; no drafts: {st['speculation_off']}"
    return ["speculation", text]


def _prefill_text(st: dict) -> str:
    """", 0.52 MB read per prompt token (1.1 passes over the experts, 1 call)"."""
    if not isinstance(st.get("expert_passes"), (int, float)):
        return ""
    prefilled = st.get("prefilled_tokens") or 0
    per_token = f"{st.get('prefill_mb_read', 0) / prefilled:.3g} MB read per prompt token, " if prefilled else ""
    calls = st.get("prefill_calls")
    calls = f", {calls} call{'s' if calls != 1 else ''}" if isinstance(calls, int) else ""
    return f", {per_token}{st['expert_passes']} passes over the experts{calls}"


def _stat_lines(st: dict) -> list[list[str]]:
    def n(key, fmt="{}"):
        v = st.get(key)
        return "-" if v is None else fmt.format(v)

    hit_rate = st.get("hit_rate")
    lines = [
        ["prompt tokens", f"{n('prompt_tokens')} (reused {n('reused_tokens')}, prefilled {n('prefilled_tokens')})"],
        ["generated tokens", n("generated_tokens") + (f" (finish: {st['finish_reason']})" if isinstance(st.get("finish_reason"), str) else "")],
        ["prefill", n("prefill_tps", "{} tok/s") + _prefill_text(st)],
        ["decode", n("decode_tps", "{} tok/s")],
        ["expert hits", f"{n('hits')} hits, {n('misses')} misses"
         + (f" ({hit_rate * 100:.1f}% hit rate)" if isinstance(hit_rate, (int, float)) else "")],
        ["evictions", n("evictions")],
        ["read from disk", f"{n('mb_read', '{} MB')} in {n('read_seconds', '{} s')}"],
        ["layer calls", f"{n('calls_no_load')} with every expert resident, {n('calls_loaded')} that read experts"],
        ["overlap", f"{n('overlapped')} calls computed during their reads, {n('prefetch_loads')} "
                    f"experts read ahead, {n('prefetch_hits')} of them used"],
        ["unplaced routes", n("unplaced")],
        ["host syncs", f"{n('syncs')} ({n('syncs_per_token')} per generated token)"],
        ["peak memory", format_size(st.get("peak_memory_bytes")) if st.get("peak_memory_bytes") is not None else "-"],
    ]
    if st.get("read_mb_per_s") is not None:
        lines[6][1] += f" ({n('read_mb_per_s', '{} MB/s')})"
    if isinstance(st.get("reused_from"), dict) and st.get("reused_tokens"):
        lines[0][1] += " from " + ", ".join(f"{source} {int(n)}" for source, n in st["reused_from"].items() if n)

    if "mb_read_per_token" in st:
        lines.insert(7, ["read per token", n("mb_read_per_token", "{} MB")])
    if "expert_slots" in st or "policy" in st:
        policy = st.get("policy") if isinstance(st.get("policy"), str) else "-"
        source = {"plan": "memory plan", "model": "model's --expert-slots", "setting": "expert_slots setting",
                  "bundled": "bundled default", "option": "-o expert_slots"}.get(st.get("slots_from"))
        lines.append(["pool", f"{slots_text(st.get('expert_slots'))} slots per layer, {policy}"
                      + (f" ({source})" if source else "")])
    if isinstance(st.get("store"), str):
        extra = []
        if st.get("threads"):
            extra.append(f"{st['threads']} threads")
        if isinstance(st.get("page_cache"), str):
            extra.append(f"page cache {st['page_cache']}")
        if isinstance(st.get("overlap"), str):
            extra.append(f"overlap {st['overlap']}")
        lines.append(["expert reads", st["store"] + (f" ({', '.join(extra)})" if extra else "")])
    lines += _long_context_lines(st)
    if isinstance(st.get("batch"), int):
        lines.append(["batch", f"decoded in a batch of up to {st['batch']} requests"])
    if (spec := _speculation_line(st)) is not None:
        lines.append(spec)
    if st.get("reuse_note"):
        lines.append(["prompt cache", f"last miss: {st['reuse_note']}"])
    return lines


@mlxs.command(short_help="The engine's figures of the last responses.")
@click.option("-n", "--count", "count", default=10, show_default=True, type=click.IntRange(1), help="Aggregate over the last N responses")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
@click.option("-d", "--database", type=click.Path(dir_okay=False, path_type=Path), help="Path to log database (default: llm's logs.db)")
@click.option("--live", is_flag=True, help="The running server's figures now (llm mlxs serve)")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw the pool's heatmap and the curves of the last N responses into FILE.svg or FILE.png")
def stats(count, json_, database, live, plot):
    """Engine figures of the last mlx-stream response, and totals over the last N."""
    check_path(plot)
    if live:
        return _live(json_, plot)
    db_path = database or (llm.user_dir() / "logs.db")
    if database is not None and not database.is_file():
        raise click.ClickException(f"No such file: {database}")
    rows = _logged(db_path, count)
    if plot is not None and rows:
        return plot_logged(rows, plot)
    if not rows:
        if json_:
            click.echo(json.dumps({"last": None, "aggregate": None}))
            return
        raise click.ClickException(f"No mlx-stream responses logged yet in {db_path}")
    last = rows[0]
    agg = aggregate(rows)
    if json_:
        click.echo(json.dumps({"last": last, "aggregate": agg}, indent=2))
        return
    when = (last["datetime_utc"] or "")[:19].replace("T", " ")
    click.echo(f"Last response  {last['model']}  {when} UTC  ({last['duration_ms']} ms)")
    if last.get("resolved_model"):
        click.echo(f"  checkpoint: {last['resolved_model']}")
    table(None, _stat_lines(last["stats"]), indent="  ")
    if last["stats"].get("ranks"):
        _rank_table("ranks (a pipeline; the figures above are every rank's together):", last["stats"]["ranks"])
    click.echo(f"\nLast {agg['responses']} response{'s' if agg['responses'] != 1 else ''}")
    table(None, _stat_lines(agg), indent="  ")


# -- the running server's figures ---------------------------------------------
def _live(json_: bool, plot: Path | None = None) -> None:
    from ..options.settings import load_settings

    server = running_server(None, load_settings())
    if server is None:
        raise click.ClickException("No mlx-stream server runs for this llm user dir (start one: llm mlxs serve)")
    if plot is not None:
        return plot_live(server, plot)
    st = server.stats()
    if json_:
        click.echo(json.dumps(st, indent=2))
        return
    if st.get("pipeline_state"):  # a pipeline's stand-in (server/process/standin.py)
        click.echo(f"Server {server.url}  state: {st['pipeline_state']} (restart {st.get('pipeline_restarts')}) "
                   f"after: {st.get('pipeline_error')}")
        return
    queue = st.get("server") or {}
    click.echo(f"Server {server.url}  state: {st.get('state')}"
               + (f" ({st['error']})" if st.get("error") else "")
               + ("  rebuilding pools" if st.get("rebuilding") else ""))
    rows = [
        ["model", f"{st.get('model') or '-'}  ({st.get('checkpoint') or 'nothing loaded'})"],
        ["requests", f"{queue.get('served', 0)} served, {st.get('batch') or 0} running (largest batch "
                     f"{st.get('largest_batch') or 0}), "
                     f"{queue.get('queued', 0)} queued (at most {queue.get('max_queue')})"],
        ["last decode", "-" if st.get("last_decode_tps") is None else f"{st['last_decode_tps']} tok/s"],
        ["memory", f"peak RSS {format_size(st.get('peak_rss_bytes') or 0)}, "
                   f"MLX {format_size(st.get('mlx_active_memory_bytes') or 0)} active, "
                   f"{format_size(st.get('mlx_cache_memory_bytes') or 0)} cached, "
                   f"{format_size(st.get('mlx_peak_memory_bytes') or 0)} peak"],
    ]
    held = (st.get("caches") or {}).get("prompt_cache") or {}
    if held.get("conversations"):
        bound = f" of at most {format_size(held['max_bytes'])}" if held.get("max_bytes") else ""
        n = held["conversations"]
        rows.append(["prompt cache", f"{n} conversation{'s' if n != 1 else ''}, {held.get('tokens', 0)} tokens, "
                     f"{format_size(held.get('bytes') or 0)}{bound}"])
    snaps = (st.get("caches") or {}).get("snapshots") or {}
    if snaps.get("max_entries"):
        rows.append(["prompt snapshots", f"{snaps.get('entries', 0)} of at most {snaps['max_entries']}, "
                     f"{format_size(snaps.get('bytes') or 0)} of at most {format_size(snaps.get('max_bytes') or 0)}"])
    if st.get("rebuild_error"):
        rows.append(["last rebuild", f"failed: {st['rebuild_error']}"])
    if st.get("pipeline_error"):
        rows.append(["pipeline", f"broken: {st['pipeline_error']}"])
    elif st.get("pipeline_restarts"):
        n = st["pipeline_restarts"]
        rows.append(["pipeline", f"restarted {n} time{'s' if n != 1 else ''}, last after: {st.get('last_pipeline_error')}"])
    table(None, rows, indent="  ")
    from ..engine.figures import read_figures

    figures = {**st, **read_figures(st)}
    shown = ("peak memory", "batch")  # the rows above say them, as the server sees them now
    table(None, [row for row in _stat_lines(figures)[4:] if row[0] not in shown], indent="  ")
    if st.get("ranks"):
        _rank_table("ranks (a pipeline; the figures above are rank 0's), since the start:", st["ranks"])
    if st.get("models"):
        _models_table(st["models"], st.get("model_loads"))


def _models_table(models: list[dict], loads) -> None:
    """Each loaded model (several share the memory budget): its share, slots, lookups and expiry."""
    budget = models[0].get("memory_budget_bytes")
    click.echo(f"  loaded models ({len(models)} of at most {models[0].get('max_models')}"
               + (f", sharing {format_size(budget)}" if budget else "") + f"; {loads} loads since the start):")
    table(["model", "state", "slots", "memory", "hits", "misses", "unloads"],
          [[m["model"], ("running" if m["running"] else "waiting") + (", pinned" if m["pinned"] else ""),
            slots_text(m["expert_slots"]), "-" if m["memory_bytes"] is None else format_size(m["memory_bytes"]),
            m["counters"]["hits"], m["counters"]["misses"],
            "when its room is needed" if m["expires_at"] is None else time.strftime("%H:%M:%S",
                                                                                     time.localtime(m["expires_at"]))]
           for m in models], indent="  ")


def _rank_table(title: str, ranks: list[dict]) -> None:
    """Each rank of a pipeline: its layers, pool, lookups, reads and time waiting for the others."""
    click.echo(f"  {title}")
    table(["rank", "host", "layers", "slots", "hits", "misses", "hit rate", "MB read", "read s", "wait s"],
          [[r["rank"], r["host"], f"{r['layers'][0]}-{r['layers'][1] - 1}", r["expert_slots"], r["hits"],
            r["misses"], "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}",
            f"{r['bytes_read'] / 1e6:.1f}", f"{r['read_seconds']:.2f}", f"{r['wait_seconds']:.2f}"]
           for r in ranks], indent="  ")
