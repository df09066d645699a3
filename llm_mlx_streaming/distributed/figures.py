"""Each rank's share of a generation: its layers, pools, reads and waits, gathered to
rank 0 after every generation for the response's figures and /api/stats."""

from __future__ import annotations

from dataclasses import fields

from ..engine import figures as fig
from ..experts.pool import PoolCounters


def param_bytes(model) -> int:
    """Bytes of every array the rank's model holds (dense weights and pool slots)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def rank_figures(rank: int, host: str, provider, before: PoolCounters, wait_seconds: float,
                 layers: tuple[int, int]) -> dict:
    """One rank's figures for one generation (`before`: its counters when it began)."""
    now = provider.counters()
    delta = {f.name: getattr(now, f.name) - getattr(before, f.name) for f in fields(PoolCounters)}
    return {
        "rank": rank, "host": host, "layers": list(layers),
        "expert_slots": provider.slots_per_layer(),
        "param_bytes": param_bytes(provider.loaded.model),
        **fig.read_figures(delta),
        "bytes_read": delta["bytes_read"],
        "wait_seconds": round(wait_seconds, 4),
    }


def totals(ranks: list[dict]) -> dict:
    """The read figures of every rank together."""
    counts = {f.name: 0 for f in fields(PoolCounters)}
    for r in ranks:
        for key in ("hits", "misses", "evictions", "reads", "unplaced", "calls_no_load",
                    "calls_loaded", "overlapped"):
            counts[key] += r[key]
        counts["bytes_read"] += r["bytes_read"]
        counts["read_seconds"] += r["read_seconds"]
    return fig.read_figures(counts)


_SUMMED = ("hits", "misses", "evictions", "bytes_read", "read_seconds", "reads", "wait_seconds")


def accumulate(running: list[dict] | None, ranks: list[dict]) -> list[dict]:
    """Each rank's counters summed over generations (for /api/stats), with its latest
    layers, slots and parameter bytes."""
    out = []
    for i, r in enumerate(ranks):
        before = running[i] if running and len(running) == len(ranks) else {}
        entry = {k: r[k] for k in ("rank", "host", "layers", "expert_slots", "param_bytes")}
        entry.update({k: before.get(k, 0) + r[k] for k in _SUMMED})
        lookups = entry["hits"] + entry["misses"]
        entry["hit_rate"] = round(entry["hits"] / lookups, 4) if lookups else None
        out.append(entry)
    return out
