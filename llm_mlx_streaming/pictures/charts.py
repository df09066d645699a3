"""The pictures `llm mlxs stats --plot` and `llm mlxs simulate --plot` write.

The same views as the server's dashboard: the pool's heatmap (MoE layers x experts:
resident or not, hits, misses) and the curves of hit rate, MB read per token, decode and
prefill tok/s and host syncs per token, here over the last responses; and, from a
replayed trace, hit rate against pool size for each policy and Belady's bound.

Every number drawn is also in the shape's `data-*` attributes (SVG) and in the
figures the PNG carries (drawing.py), so a picture can be checked against its stats.
"""

from __future__ import annotations

import math

from .drawing import Drawing

GREY, COLD, HOT, RED = "#e8ecf1", "#b9d3ec", "#1f5fa8", "#e0533d"
INK, MUTED, LINE = "#1d2733", "#6a7786", "#e2e7ee"
POLICY_COLOURS = ("#1f5fa8", "#2e9d5b", "#d99a1e", "#8e6cc6", "#17a2b8", "#c2185b")

# (key, title, colour, format): the curves, as the dashboard draws them
CURVES = (
    ("hit_rate", "hit rate", "#1f5fa8", lambda v: f"{v * 100:.1f}%"),
    ("mb_read_per_token", "MB read per token", "#e0533d", lambda v: f"{v:.2f} MB"),
    ("decode_tps", "decode tok/s", "#2e9d5b", lambda v: f"{v:.1f}"),
    ("prefill_tps", "prefill tok/s", "#d99a1e", lambda v: f"{v:.0f}"),
    ("syncs_per_token", "host syncs per token", "#8e6cc6", lambda v: f"{v:.2f}"),
)


def mix(a: str, b: str, t: float) -> str:
    t = max(0.0, min(1.0, t))
    ca, cb = (int(a[i:i + 2], 16) for i in (1, 3, 5)), (int(b[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb))


def cell_colour(resident, hits: int, most: int) -> str:
    """Grey when not resident; blue, darker the more it was hit, when resident (or when
    residency is unknown, a replayed trace)."""
    if resident is False:
        return GREY
    if hits <= 0 or most <= 0:
        return COLD
    return mix(COLD, HOT, 0.25 + 0.75 * math.log1p(hits) / math.log1p(most))


# -- the heatmap -----------------------------------------------------------------------
def heatmap(d: Drawing, x: float, y: float, width: float, heat: dict) -> float:
    """Draw `heat` ({"title", "note", "rows": [{"name", "slots", "resident" (a "0101" string
    or None), "lookups": [per expert], "misses": [per expert]}]}); returns the height used."""
    rows = heat.get("rows") or []
    experts, cw, ch = _heat_geometry(heat, width)
    d.text(x, y + 14, heat.get("title", "expert pool"), size=13, bold=True)
    if not rows or not experts:
        d.text(x, y + 34, "no pool figures", fill=MUTED)
        return 44
    left, top = 34, y + 40
    most = max((lk - m for r in rows for lk, m in zip(r["lookups"], r["misses"])), default=0)
    step = max(1, math.ceil(22 / cw))
    for e in range(0, experts, step):
        d.text(x + left + e * cw + cw / 2, top - 5, str(e), size=9, fill=MUTED, anchor="middle")
    row_step = max(1, math.ceil(11 / ch))
    gap = 1 if cw >= 6 else 0
    for i, r in enumerate(rows):
        cy = top + i * ch
        if i % row_step == 0:
            d.text(x + left - 5, cy + ch / 2 + 4, str(r["name"]), size=9, fill=MUTED, anchor="end")
            d.text(x + left + experts * cw + 5, cy + ch / 2 + 4, str(r.get("slots", "")), size=9, fill=MUTED)
        resident = r.get("resident")
        for e, (lookups, misses) in enumerate(zip(r["lookups"], r["misses"])):
            state = None if resident is None else resident[e] == "1"
            hits = lookups - misses
            d.rect(x + left + e * cw, cy, cw - gap, ch - gap, cell_colour(state, hits, most),
                   layer=r["name"], expert=e, hits=hits, misses=misses,
                   resident="unknown" if state is None else int(state))
            if misses and lookups:
                share = misses / lookups
                side_w, side_h = max(2, round((cw - gap) * (0.3 + 0.5 * share))), max(2, round((ch - gap) * (0.3 + 0.5 * share)))
                d.rect(x + left + e * cw + (cw - gap - side_w) // 2, cy + (ch - gap - side_h) // 2, side_w, side_h, RED)
    bottom = top + len(rows) * ch + 16
    legend = [(GREY, "not resident"), (COLD, "resident, few hits"), (HOT, "many hits"), (RED, "misses (share of lookups)")]
    lx = x + left
    for colour, label in legend:
        d.rect(lx, bottom - 9, 10, 10, colour)
        d.text(lx + 14, bottom, label, size=10, fill=MUTED)
        lx += 24 + 6.2 * len(label)
    if heat.get("note"):
        d.text(x + left, bottom + 16, heat["note"], size=10, fill=MUTED)
    return bottom + 24 - y


def _heat_geometry(heat: dict, width: float) -> tuple[int, int, int]:
    """(experts, cell width, cell height) of `heat` drawn `width` wide."""
    rows = heat.get("rows") or []
    experts = max((len(r["lookups"]) for r in rows), default=0)
    cw = max(3, min(28, int((width - 74) // max(1, experts))))
    return experts, cw, max(3, min(20, int(360 // max(1, len(rows))), cw))


def heatmap_height(heat: dict | None, width: float) -> float:
    if heat is None:
        return 0
    experts, _, ch = _heat_geometry(heat, width)
    if not heat.get("rows") or not experts:
        return 50
    return 40 + len(heat["rows"]) * ch + 16 + 24 + 8


def tick(v: float, top: float) -> str:
    """An axis label with as many digits as the axis' scale needs."""
    if v == 0:
        return "0"
    return f"{v:.0f}" if top >= 10 else f"{v:.1f}" if top >= 1 else f"{v:.2g}"


# -- one curve ----------------------------------------------------------------------------
def curve(d: Drawing, x: float, y: float, w: float, h: float, title: str, colour: str, fmt,
          points: list[tuple[float, float | None]], key: str, x_label: str, top: float | None = None) -> None:
    """A small line chart of `points` (x, value or None); each drawn point carries its value."""
    values = [v for _, v in points if v is not None]
    d.rect(x, y, w, h, "#ffffff")
    d.text(x, y + 13, title, size=11, fill=MUTED, bold=True)
    if values:
        d.text(x + w, y + 14, fmt(values[-1]), size=13, anchor="end", bold=True)
    L, T, B, R = 40, 24, 18, 8
    pw, ph = w - L - R, h - T - B
    top = top or (max(values) * 1.15 if values and max(values) > 0 else 1.0)
    xs = [p for p, _ in points]
    x0, x1 = (min(xs), max(xs)) if xs else (0, 1)
    span = (x1 - x0) or 1
    X = lambda p: x + L + pw * ((p - x0) / span if len(xs) > 1 else 0.5)  # noqa: E731
    Y = lambda v: y + T + ph * (1 - v / top)  # noqa: E731
    for v in (0, top / 2, top):
        d.line([(x + L, Y(v)), (x + L + pw, Y(v))], LINE, 1)
        label = f"{v * 100:.0f}%" if key == "hit_rate" else tick(v, top)
        d.text(x + L - 4, Y(v) + 3, label, size=9, fill=MUTED, anchor="end")
    if not values:
        d.text(x + L + pw / 2, y + T + ph / 2, "no data", size=10, fill=MUTED, anchor="middle")
    run: list = []
    for p, v in points + [(None, None)]:
        if v is None:
            if run:
                d.line(run, colour, 1.8)
            run = []
        else:
            run.append((X(p), Y(v)))
    for i, (p, v) in enumerate(points):
        if v is not None:
            d.circle(X(p), Y(v), 2.5, colour, series=key, index=i, at=p, value=v)
    d.text(x + L, y + h - 3, x_label, size=9, fill=MUTED)


# -- the pictures ---------------------------------------------------------------------------
def response_values(responses: list[dict]) -> dict[str, list]:
    """The curves' values, one per response (oldest first): the figures as logged, and
    MB read per generated token."""
    out = {key: [] for key, *_ in CURVES}
    for r in responses:
        mb, generated = r.get("mb_read"), r.get("generated_tokens")
        derived = {"mb_read_per_token": round(mb / generated, 4) if isinstance(mb, (int, float)) and generated else None}
        for key, *_ in CURVES:
            value = derived[key] if key in derived else r.get(key)
            out[key].append(value if isinstance(value, (int, float)) and not isinstance(value, bool) else None)
    return out


def stats_picture(title: str, subtitle: str, responses: list[dict], heat: dict | None) -> Drawing:
    """The heatmap (if any) over the curves of the last responses (oldest first)."""
    width = 980
    values = response_values(responses)
    heat_height = heatmap_height(heat, width - 40)
    d = Drawing(width, 70 + heat_height + 2 * 170 + 20, background="#f4f6f9")
    d.figures = {"title": title, "responses": values, "heatmap": heat}
    d.text(20, 28, title, size=16, bold=True)
    d.text(20, 48, subtitle, size=11, fill=MUTED)
    y = 64
    if heat is not None:
        d.rect(12, y, width - 24, heat_height, "#ffffff")
        heatmap(d, 20, y + 4, width - 40, heat)
        y += heat_height + 10
    n = len(responses)
    label = f"the last {n} response{'s' if n != 1 else ''}, oldest left" if n else "no responses"
    cw, chh = (width - 24 - 2 * 12) / 3, 160
    for i, (key, name, colour, fmt) in enumerate(CURVES):
        cx, cy = 12 + (i % 3) * (cw + 12), y + (i // 3) * (chh + 10)
        curve(d, cx, cy, cw, chh, name, colour, fmt, list(enumerate(values[key], start=1)), key, label,
              top=1.0 if key == "hit_rate" else None)
    if responses:  # the sixth place: the last response in words
        last, cx, cy = responses[-1], 12 + 2 * (cw + 12), y + chh + 10
        d.rect(cx, cy, cw, chh, "#ffffff")
        d.text(cx, cy + 13, "the last response", size=11, fill=MUTED, bold=True)
        lines = [("prompt", f"{last.get('prompt_tokens', '-')} tokens ({last.get('reused_tokens', 0)} reused)"),
                 ("generated", f"{last.get('generated_tokens', '-')} tokens"),
                 ("first token", f"{last['ttft_seconds']} s" if isinstance(last.get("ttft_seconds"), (int, float)) else "-"),
                 ("hits, misses", f"{last.get('hits', '-')}, {last.get('misses', '-')}"),
                 ("MB read", str(last.get("mb_read", "-"))),
                 ("slots, policy", f"{last.get('expert_slots', '-')}, {last.get('policy', '-')}")]
        for i, (k, v) in enumerate(lines):
            d.text(cx + 4, cy + 38 + 19 * i, k, size=11, fill=MUTED)
            d.text(cx + 110, cy + 38 + 19 * i, str(v), size=11)
    return d


def simulate_picture(title: str, rows: list[dict], heat: dict | None) -> Drawing:
    """Hit rate against pool size, each policy and Belady (dashed), and the heatmap of
    the replay, from `llm_mlx_streaming.experts.simulate.simulate` rows."""
    width = 980
    heat_height = heatmap_height(heat, width - 40)
    chart_h = 340
    d = Drawing(width, 70 + chart_h + 20 + heat_height + 20, background="#f4f6f9")
    names = list(rows[0]["hit_rate"]) if rows else []
    d.figures = {"title": title, "simulate": [{"slots": r["slots"], "hit_rate": r["hit_rate"], "belady": r["belady"]}
                                               for r in rows], "heatmap": heat}
    d.text(20, 28, title, size=16, bold=True)
    if rows:
        r0 = rows[0]
        d.text(20, 48, f"{r0['accesses']:,} accesses per pool size: {r0['sequences']} sequences x {r0['layers']} layers, "
                       f"{r0['experts']} experts, per-layer pools from cold", size=11, fill=MUTED)
    x, y, w, h = 12, 64, width - 24, chart_h
    d.rect(x, y, w, h, "#ffffff")
    d.text(x + 10, y + 18, "hit rate against pool size (slots per layer)", size=13, bold=True)
    L, T, B, R = 56, 40, 36, 150
    pw, ph = w - L - R, h - T - B
    slots = [r["slots"] for r in rows]
    lo, hi = (min(slots), max(slots)) if slots else (0, 1)
    X = lambda s: x + L + pw * ((s - lo) / (hi - lo) if hi > lo else 0.5)  # noqa: E731
    Y = lambda v: y + T + ph * (1 - v)  # noqa: E731
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        d.line([(x + L, Y(v)), (x + L + pw, Y(v))], LINE, 1)
        d.text(x + L - 6, Y(v) + 3, f"{v * 100:.0f}%", size=10, fill=MUTED, anchor="end")
    for s in slots:
        d.text(X(s), y + h - B + 16, str(s), size=10, fill=MUTED, anchor="middle")
    d.text(x + L + pw / 2, y + h - 6, "slots per layer", size=10, fill=MUTED, anchor="middle")
    series = [(n, POLICY_COLOURS[i % len(POLICY_COLOURS)], [r["hit_rate"][n] for r in rows], False)
              for i, n in enumerate(names)]
    series.append(("belady", INK, [r["belady"] for r in rows], True))
    for i, (name, colour, values, dashed) in enumerate(series):
        pts = [(X(s), Y(v)) for s, v in zip(slots, values) if v == v]  # NaN: no accesses
        d.line(pts, colour, 2, dash=dashed)
        for s, v in zip(slots, values):
            if v == v:
                d.circle(X(s), Y(v), 3, colour, series=name, slots=s, value=v)
        ly = y + T + 18 * i
        d.line([(x + L + pw + 16, ly - 4), (x + L + pw + 40, ly - 4)], colour, 2, dash=dashed)
        d.text(x + L + pw + 46, ly, "Belady (bound)" if name == "belady" else name.upper(), size=11)
    y += h + 10
    if heat is not None:
        d.rect(12, y, width - 24, heat_height, "#ffffff")
        heatmap(d, 20, y + 4, width - 40, heat)
    return d
