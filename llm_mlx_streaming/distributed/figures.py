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
