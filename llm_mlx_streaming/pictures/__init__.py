"""Pictures of the pool, as SVG or PNG, with no plotting library: `llm mlxs stats --plot`
and `llm mlxs simulate --plot` (charts.py draws, drawing.py writes, font.py is the PNG's
text). The heatmap's rows come from the server's pool counters (`live_heat`) or from a
routing trace replayed as the engine would have run it (`replayed_heat`).
"""

from __future__ import annotations

from .charts import simulate_picture, stats_picture
from .drawing import Drawing, read_png

__all__ = ["Drawing", "live_heat", "read_png", "replayed_heat", "simulate_picture", "stats_picture"]


def live_heat(frame: dict, title: str = "expert pool now") -> dict | None:
    """A heatmap from a dashboard frame (`/dashboard/snapshot`): each pool's residency
    and its lookups and misses per expert since it was built."""
    rows = (frame.get("heatmap") or {}).get("rows") or []
    if not rows:
        return None
    out = []
    for r in rows:
        lookups, misses = [0] * r["experts"], [0] * r["experts"]
        for e, n in r["lookups"]:
            lookups[e] = n
        for e, n in r["misses"]:
            misses[e] = n
        out.append({"name": r["name"], "slots": r["slots"], "resident": r["resident"],
                    "lookups": lookups, "misses": misses})
    return {"title": title, "rows": out,
            "note": "rows: MoE layers (and extra pools); cells: experts; counts since each pool was built"}


def replayed_heat(sequences: list, slots, policy: str, title: str, note: str = "") -> dict:
    """A heatmap of trace `sequences` (experts/traces.py) replayed through per-layer pools
    of `slots` (one count, or one per layer) evicting with `policy`: each layer's lookups
    and misses per expert (experts/simulate.py's `replay`, each sequence from cold)."""
    from ..experts.simulate import replay

    layers = max((s.layers for s in sequences), default=0)
    experts = max((s.experts for s in sequences), default=0)
    rows = []
    for layer in range(layers):
        count = slots[layer] if isinstance(slots, (list, tuple)) else slots
        count = min(int(count or experts), experts)
        lookups, misses = [0] * experts, [0] * experts
        for seq in sequences:
            if layer < len(seq.layer_seqs):
                replay(seq.layer_seqs[layer], count, policy, (lookups, misses))
        rows.append({"name": str(layer), "slots": count, "resident": None, "lookups": lookups, "misses": misses})
    return {"title": title, "rows": rows, "note": note}
