"""The engine's figures, named and computed in one place.

A response's figures (its `response_json`, which `llm mlxs stats` reads back from
logs.db) and the engine's live ones (`/api/stats`, `llm mlxs stats --live`) are built
here from the same counters, so one name always means one quantity.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import fields

from .. import syncs
from . import worker
from ..experts.pool import PoolCounters
from ..activity import ACTIVITY
from .kv import bits_in_use, cache_bytes, kept_note


def peak_rss_bytes() -> int:
    """Peak resident set size: ru_maxrss is bytes on macOS, KiB on Linux."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def store_in_use(loaded) -> str | None:
    """Which copy of the experts reads come from: "packed", "safetensors" (None: no model)."""
    if loaded is None:
        return None
    packed = getattr(loaded.store, "packed", None)
    return "packed" if packed is not None and not getattr(packed, "disabled", None) else "safetensors"


def slots_per_layer(loaded) -> int | list[int] | None:
    """Slots per MoE layer: one number when every layer has the same."""
    # (a pool being rebuilt is None for a moment; the server reads this meanwhile)
    slots = [pool.slots for pool in (loaded.pools if loaded else []) if pool is not None]
    if not slots:
        return None
    return slots[0] if len(set(slots)) == 1 else slots


def pool_counters(loaded, retired: PoolCounters) -> PoolCounters:
    """Counters summed over every pool (an MTP head's included) and the `retired` ones."""
    total = PoolCounters()
    total.add(retired)
    for pool in loaded.all_pools if loaded else []:
        if pool is not None:  # None while it is being rebuilt
            total.add(pool.counters)
    return total


def read_figures(counts: dict) -> dict:
    """Expert lookups and disk reads, from pool counters (`PoolCounters.as_dict()`, or
    the difference of two)."""
    lookups = counts["hits"] + counts["misses"]
    return {
        "hits": counts["hits"],
        "misses": counts["misses"],
        "hit_rate": round(counts["hits"] / lookups, 4) if lookups else None,
        "evictions": counts["evictions"],
        "mb_read": round(counts["bytes_read"] / 1e6, 3),
        "read_seconds": round(counts["read_seconds"], 4),
        "reads": counts["reads"],
        "read_mb_per_s": round(counts["bytes_read"] / counts["read_seconds"] / 1e6, 1)
        if counts["read_seconds"] else None,
        "unplaced": counts["unplaced"],
        "calls_no_load": counts["calls_no_load"],
        "calls_loaded": counts["calls_loaded"],
        "overlapped": counts["overlapped"],
        "prefetch_loads": counts["prefetch_loads"],
        "prefetch_hits": counts["prefetch_hits"],
    }


def sync_figures(syncs: float, tokens: int) -> dict:
    """Host synchronisations (llm_mlx_streaming/syncs.py) and their share per generated token."""
    return {"syncs": round(syncs, 3), "syncs_per_token": round(syncs / tokens, 3) if tokens else None}


def response_figures(provider, before: PoolCounters, last, prompt: int, reused: int, prefilled: int,
                     seconds: float, syncs: float) -> dict:
    """One generation's figures; `last` is its final mlx-lm GenerationResponse and
    `syncs` the host synchronisations it made."""
    import mlx.core as mx

    now = provider.counters()
    delta = {f.name: getattr(now, f.name) - getattr(before, f.name) for f in fields(PoolCounters)}
    generated = last.generation_tokens if last else 0
    return {
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "prefilled_tokens": prefilled,
        "generated_tokens": generated,
        "prefill_tps": round(last.prompt_tps, 2) if last else None,
        "decode_tps": round(last.generation_tps, 2) if last else None,
        "seconds": round(seconds, 3),
        **read_figures(delta),
        **sync_figures(syncs, generated),
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "expert_slots": provider.slots_per_layer(),
        "policy": provider.policy,
        "store": store_in_use(provider.loaded),
        "threads": provider.threads,
        "page_cache": provider.page_cache,
        "overlap": provider.overlap,
        "checkpoint": str(provider.checkpoint),
        "finish_reason": last.finish_reason if last else None,
    }


def reuse_figures(reuse, prompts, taken: int) -> dict:
    """Where a prompt's reused tokens came from (memory, snapshot, disk), why not more,
    and, where the model keeps snapshots, those this generation took and those its prompt
    cache holds (engine/prompt_cache.py)."""
    figures = {"reused_from": reuse.source, "reuse_note": reuse.note}
    if prompts.snapshots is not None:
        figures.update(snapshots_taken=taken, snapshots=prompts.snapshot_count, snapshot_bytes=prompts.snapshot_bytes)
    return figures


class ReadsDuring:
    """The pools' counters from now until `stop()`: what a prompt's prefill read."""

    def __init__(self, provider):
        self.provider = provider
        self.before = provider.counters()
        self.after = None

    def stop(self) -> None:
        if self.after is None:
            self.after = self.provider.counters()

    def delta(self) -> PoolCounters:
        after = self.after or self.provider.counters()
        return PoolCounters(**{f.name: getattr(after, f.name) - getattr(self.before, f.name) for f in fields(PoolCounters)})


def prefill_figures(reads: ReadsDuring, fed, loaded) -> dict:
    """What a prompt's prefill read, up to its first token: `expert_passes` is the experts
    read (on demand or ahead) over the routed experts of all MoE layers, 1.0 being one
    read of each (engine/prefill.py); its model calls and what it could not tile."""
    delta = reads.delta()
    experts = sum(pool.num_experts for pool in (loaded.pools if loaded else []) if pool is not None)
    read = delta.misses + delta.prefetch_loads
    return {
        "expert_passes": round(read / experts, 3) if experts else None,
        "prefill_mb_read": round(delta.bytes_read / 1e6, 3),
        "prefill_read_seconds": round(delta.read_seconds, 4),
        "prefill_calls": fed.calls,
        **({"untiled_calls": fed.untiled} if fed.untiled else {}),
    }


def kv_figures(cache, kv, kv_note, prefill_step: int, ttft: float | None) -> dict:
    """The KV cache a generation left and how its prompt was prefilled."""
    figures = {
        "kv_bits": bits_in_use(cache),
        "kv_bytes": cache_bytes(cache),
        "prefill_step": prefill_step,
        "ttft_seconds": round(ttft, 4) if ttft is not None else None,
    }
    if kv.quantized:
        figures.update(kv_group_size=kv.group_size, kv_start=kv.start)
        kv_note = kv_note or kept_note(cache)
    if kv_note:
        figures["kv_note"] = kv_note
    return figures


def engine_figures(manager) -> dict:
    """The engine's state now: what runs, memory, and the running model's counters since its load."""
    import mlx.core as mx

    model = manager.running
    return {
        "state": manager.state,
        "error": manager.error,
        "checkpoint": str(model.checkpoint) if model is not None else None,
        "expert_slots": model.slots_per_layer() if model is not None else None,
        "policy": model.policy if model is not None else None,
        "threads": model.threads if model is not None else None,
        "page_cache": model.page_cache if model is not None else None,
        "overlap": model.overlap if model is not None else None,
        "store": store_in_use(manager.loaded),
        "max_tokens": manager.max_tokens,
        "peak_rss_bytes": peak_rss_bytes(),
        "mlx_active_memory_bytes": int(mx.get_active_memory()),
        "mlx_cache_memory_bytes": int(mx.get_cache_memory()),
        "mlx_peak_memory_bytes": int(mx.get_peak_memory()),
        "last_decode_tps": manager.last_decode_tps,
        "requests_served": manager.served,
        "requests_queued": manager.queued,
        "engine_idle": worker.idle(),  # nothing running or queued, freed memory given back
        "batch": manager.batch,
        "largest_batch": manager.largest_batch,
        "generated_tokens": manager.generated,
        **sync_figures(syncs.count() - manager.syncs_at_start, manager.generated),
        **manager.counters().as_dict(),
        "totals": ACTIVITY.totals_shown(),  # every finished generation's tokens and seconds
        "in_flight": ACTIVITY.in_flight(),
        "caches": cache_figures(model),
    }


def cache_figures(model) -> dict:
    """What the running model keeps between requests, each with its bound (docs/server.md,
    "What a long-running server keeps")."""
    import mlx.core as mx

    prompts = model.prompts if model is not None else None
    carried = model.carried if model is not None else None
    disk, spec = carried.disk if carried else None, prompts.snapshots if prompts else None
    return {
        "prompt_cache": {"conversations": prompts.conversation_count if prompts else 0,
                         "tokens": prompts.conversation_tokens if prompts else 0,
                         "bytes": prompts.conversation_bytes if prompts else 0,
                         "max_bytes": prompts.max_bytes if prompts else None},
        "snapshots": {"entries": prompts.snapshot_count if spec else 0, "bytes": prompts.snapshot_bytes if spec else 0,
                      "max_entries": spec.max_count if spec else None,
                      "max_bytes": spec.max_bytes if spec else None},
        "buffer_cache": {"bytes": int(mx.get_cache_memory()), "max_bytes": model.buffer_cache if model else None},
        "conversation_cache": {"bytes": disk.bytes if disk else None,
                               "max_bytes": disk.spec.max_bytes if disk else None,
                               "entries": disk.entries if disk else None,
                               "max_entries": disk.spec.max_entries if disk else None},
        "drafters": {"entries": len(carried.drafters) if carried else 0, "max_entries": 1},  # the last built (speculation/start.py)
    }


def layer_figures(loaded) -> list[dict]:
    """Each MoE layer's slots and counters (a layer whose pool is being rebuilt is left out)."""
    return [{"layer": i, "slots": pool.slots, **pool.counters.as_dict()}
            for i, pool in enumerate(loaded.pools if loaded else []) if pool is not None]
