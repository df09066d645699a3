"""The dashboard's figures: one frame of what the server and the engine are doing.

A frame is computed only while a dashboard listens (at most `FRAMES_PER_SECOND`), on
the event loop, from what already exists: `Service.stats()` (the /api/stats figures),
activity.py (requests in flight, finished responses), and each pool's own
counters and expert->slot map (experts/pool.py), copied, never synchronised with the
device. The engine thread does no work for it.

Heatmap rows go out as increments since the client's previous frame (the first frame's
are since the pool was built), so a client adds them up and decays its "recent" view.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ... import syncs
from ...activity import ACTIVITY

FRAMES_PER_SECOND = 2  # the event stream's rate: "at most a few per second"
SERIES_SECONDS = 600  # the curves' memory: the last ten minutes the dashboard was open
WINDOW_SECONDS = 3.0  # each point of a curve: rates over this much time before it


def _engine():
    from ...engine.manager import get_manager

    return get_manager()


class Feed:
    """The frames of one server: the curves' samples."""

    def __init__(self) -> None:
        self.listeners = 0
        self.samples: deque[dict] = deque(maxlen=SERIES_SECONDS * FRAMES_PER_SECOND + 8)
        self.points: deque[dict] = deque(maxlen=SERIES_SECONDS * FRAMES_PER_SECOND + 8)

    # -- memory -----------------------------------------------------------------------
    @staticmethod
    def memory(service) -> dict:
        """The memory in use, summed over the loaded models and one entry per model
        (`models`: the dashboard's rows, /metrics' `model` label), from the engine's
        records (engine/residents.py) and a running batch's KV caches."""
        from ...options.settings import budget_bytes, physical_memory

        models = [{"model": m["model"], "dense_bytes": m["dense_bytes"], "experts_bytes": m["experts_bytes"],
                   "slots": m["slots"], "kv_bytes": _batch_kv_bytes() if m["running"] and ACTIVITY.batch
                   else m["kv_bytes"]} for m in service.models_figures()]
        try:
            budget = budget_bytes(str(service.config().get("memory_budget") or "auto"))
        except Exception:
            budget = None
        total = {k: sum(m[k] for m in models) for k in ("dense_bytes", "experts_bytes", "kv_bytes", "slots")}
        return {**total, "budget_bytes": budget, "machine_bytes": physical_memory(), "models": models}

    # -- the heatmap ------------------------------------------------------------------
    @staticmethod
    def pools() -> list[tuple[str, object]]:
        loaded = _engine().loaded
        if loaded is None:
            return []
        rows = [(str(i), p) for i, p in enumerate(loaded.pools)]
        rows += [(name, a.pool) for name, a in loaded.attachments.items()]
        return [(name, p) for name, p in rows if p is not None]

    @staticmethod
    def heatmap(seen: dict) -> dict:
        """Each pool's resident experts, and its lookups and misses per expert since
        `seen` (the client's last copy, by pool; updated here)."""
        rows, experts, current = [], 0, {}
        for name, pool in Feed.pools():
            lookups, misses = pool.expert_lookups.copy(), pool.expert_misses.copy()
            before = seen.get(id(pool))
            new_lookups = lookups - before[0] if before is not None else lookups
            new_misses = misses - before[1] if before is not None else misses
            current[id(pool)] = (lookups, misses)
            experts = max(experts, pool.num_experts)
            rows.append({"name": name, "slots": pool.slots, "experts": pool.num_experts,
                         "resident": ((pool.slot_of >= 0).view(np.uint8) + ord("0")).tobytes().decode(),
                         "lookups": _sparse(new_lookups), "misses": _sparse(new_misses)})
        reset = set(current) != set(seen)
        seen.clear()
        seen.update(current)
        return {"experts": experts, "rows": rows, "reset": reset}

    # -- the curves -------------------------------------------------------------------
    def sample(self, stats: dict, now: float) -> None:
        """Record the counters now (at most FRAMES_PER_SECOND times a second, whatever
        the number of dashboards) and the curve point they end."""
        if self.samples and now - self.samples[-1]["t"] < 0.9 / FRAMES_PER_SECOND:
            return
        sample = {"t": now, "hits": stats.get("hits") or 0, "misses": stats.get("misses") or 0,
                  "bytes": stats.get("bytes_read") or 0, "syncs": syncs.count(),
                  "generated": ACTIVITY.live_generated, "prefilled": ACTIVITY.prefilled_now()}
        self.samples.append(sample)
        start = next((s for s in self.samples if now - s["t"] <= WINDOW_SECONDS), sample)
        if start is not sample:
            self.points.append(_rates(start, sample))

    # -- a frame ----------------------------------------------------------------------
    def frame(self, service, client: "Client") -> dict:
        """The next frame for `client` (what it has not seen yet)."""
        stats = service.stats()
        now = time.time()
        self.sample(stats, now)
        keep = ("state", "error", "checkpoint", "expert_slots", "policy", "store", "threads", "overlap",
                "page_cache", "max_tokens", "peak_rss_bytes", "mlx_active_memory_bytes", "mlx_peak_memory_bytes",
                "last_decode_tps", "requests_served", "requests_queued", "batch", "largest_batch",
                "generated_tokens", "syncs", "syncs_per_token", "hits", "misses", "hit_rate", "evictions",
                "bytes_read", "read_seconds", "read_mb_per_s", "model", "rebuilding", "rebuild_error",
                "server", "in_flight", "totals", "ranks", "pipeline_error", "pipeline_restarts",
                "last_pipeline_error")
        first = client.frames == 0
        client.frames += 1
        series = [p for p in self.points if p["t"] > client.last_point]
        recent = ACTIVITY.recent_responses(client.last_response)
        if series:
            client.last_point = series[-1]["t"]
        if recent:
            client.last_response = recent[-1]["n"]
        memory = self.memory(service)
        held = {m["model"]: m for m in memory["models"]}
        return {
            "t": round(now, 3),
            **{k: stats.get(k) for k in keep if k in stats},
            "max_batch": service.turns.gate.capacity,
            "memory": memory,
            "models": [{**m, **held.get(m["model"], {})} for m in stats.get("models") or ()],  # a row each
            "heatmap": self.heatmap(client.seen),
            "recent": recent,
            "series": series,
            "first": first,
        }


class Client:
    """What one dashboard has been sent."""

    def __init__(self) -> None:
        self.frames = 0
        self.seen: dict = {}  # pool id -> (lookups, misses) per expert, as last sent
        self.last_point = 0.0  # the last curve point sent (its time)
        self.last_response = 0  # the last finished response sent (its number)


def _batch_kv_bytes() -> int:
    """The running batch's KV caches (its members' checked out of their model's prompt cache)."""
    try:
        batch = ACTIVITY.batch
        return batch.kv_bytes() if batch is not None else 0
    except Exception:  # a cache being swapped on the engine thread: next frame
        return 0


def _sparse(values: np.ndarray) -> list[list[int]]:
    nz = np.nonzero(values)[0]
    return [[int(e), int(values[e])] for e in nz]


def _rates(a: dict, b: dict) -> dict:
    """A curve point: rates between two samples (None where nothing happened)."""
    dt = b["t"] - a["t"]
    hits, misses = b["hits"] - a["hits"], b["misses"] - a["misses"]
    generated, prefilled = b["generated"] - a["generated"], b["prefilled"] - a["prefilled"]
    mb, syncs_ = (b["bytes"] - a["bytes"]) / 1e6, b["syncs"] - a["syncs"]
    return {
        "t": round(b["t"], 3),
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "mb_per_token": round(mb / generated, 4) if generated else None,
        "decode_tps": round(generated / dt, 2) if generated and dt > 0 else None,
        "prefill_tps": round(prefilled / dt, 2) if prefilled and dt > 0 else None,
        "syncs_per_token": round(syncs_ / generated, 3) if generated else None,
    }
