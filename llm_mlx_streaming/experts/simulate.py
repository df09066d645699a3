"""Replay recorded expert-routing traces through the pool's eviction policies.

A trace (traces.py: its format, written by engine/trace.py) holds one routed sequence
per line.

The replay mirrors the engine (``experts/switch.py`` and ``ExpertPool.ensure``), one pool
per MoE layer, cold at the start of every sequence. For one layer call, ``needed`` is the
distinct experts of the step in router order; the resident ones are hits and are recorded;
each miss takes a free slot or evicts the policy's victim among the residents the call does
not need; then the misses are recorded. A step with more distinct experts than slots (a
prefill) runs expert-major: resident experts first, then the rest, in calls of at most
``slots`` experts.

``belady`` replays the same calls with Belady's MIN eviction (the resident, unneeded expert
used again furthest in the future; never-used-again first): the offline optimum when every
step fits the pool. ``simulate`` sweeps slot counts over a whole file and ``format_table``
prints the result.
"""

from __future__ import annotations

import heapq
import math
import operator
import os
from typing import Iterable, Optional

from .policies import POLICIES, make_policy
from .traces import Step, load_trace


def _check_slots(slots) -> int:
    if isinstance(slots, bool):
        raise ValueError(f"slot count must be an integer, got {slots!r}")
    try:
        slots = operator.index(slots)
    except TypeError:
        raise ValueError(f"slot count must be an integer, got {slots!r}") from None
    if slots < 1:
        raise ValueError(f"slot count must be >= 1, got {slots}")
    return slots


def split_step(step: Iterable[int], resident, slots: int) -> list[list[int]]:
    """The pool calls one step makes, as the engine's ``StreamingExperts`` makes them.

    ``needed`` is the step's distinct experts in router order. If they fit the pool that
    is one call; otherwise the engine runs expert-major: the needed experts already
    resident first, then the rest, each group in router order, in chunks of ``slots``.
    """
    needed = list(dict.fromkeys(step))
    if len(needed) <= slots:
        return [needed]
    order = [e for e in needed if e in resident] + [e for e in needed if e not in resident]
    return [order[i : i + slots] for i in range(0, len(order), slots)]


def replay(steps: Iterable[Step], slots: int, policy_name: str, per_expert=None) -> tuple[int, int]:
    """(hits, accesses) of one layer's step sequence through a cold pool of ``slots``
    slots evicting with ``policy_name`` (see ``policies.make_policy``).

    Each call does what ``ExpertPool.ensure`` does: the resident experts it needs are
    hits, recorded in router order; then each miss takes a free slot or evicts the
    policy's victim among the residents the call does not need (forgotten at once); then
    the misses are recorded, in router order. Accesses are distinct experts per call.
    ``per_expert``, when given, is a pair of mutable sequences (accesses, misses) indexed
    by expert id that the replay adds to (the pictures' heatmap).
    """
    slots = _check_slots(slots)
    policy = make_policy(policy_name, slots)
    resident: set[int] = set()
    hits = accesses = 0
    for step in steps:
        if not step:
            continue
        for call in split_step(step, resident, slots):
            accesses += len(call)
            protected = set(call)
            misses = []
            for e in call:
                if e in resident:
                    policy.record(e)
                    hits += 1
                else:
                    misses.append(e)
            if per_expert is not None:
                for e in call:
                    per_expert[0][e] += 1
                for e in misses:
                    per_expert[1][e] += 1
            for _ in range(len(misses) - (slots - len(resident))):
                v = policy.victim(resident, protected)
                policy.forget(v)
                resident.discard(v)
            for e in misses:
                resident.add(e)
                policy.record(e)
    return hits, accesses


def belady(steps: Iterable[Step], slots: int) -> tuple[int, int]:
    """(hits, accesses) of Belady's MIN on the same calls as ``replay``: each eviction
    takes the resident expert the call does not need whose next use is furthest away (one
    never used again first). This is the offline optimum when every step fits the pool
    (each decode step when ``slots >= top_k``): the tests check it against a brute-force
    search. A step that does not fit is split resident-first, so what an eviction keeps
    changes how later over-sized steps are split; no greedy rule is optimal then, and MIN
    is a strong heuristic rather than a bound (``simulate`` counts such steps).

    O(n log n) in the number of accesses: next uses (by step) come from one backward pass
    and residents sit in a max-heap keyed by next use, with lazy deletion.
    """
    slots = _check_slots(slots)
    seq = [list(dict.fromkeys(s)) for s in steps if s]
    n = len(seq)
    never = n  # "next use" of an expert never used again: after every step
    nxt: list[list[int]] = [None] * n  # type: ignore[list-item]  # aligned with seq[i]
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        needed = seq[i]
        nxt[i] = [last.get(e, never) for e in needed]
        for e in needed:
            last[e] = i
    cur: dict[int, int] = {}  # resident expert -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, expert); stale entries are skipped
    push, pop = heapq.heappush, heapq.heappop
    hits = accesses = 0
    for i, needed in enumerate(seq):
        if len(needed) <= slots:
            calls = (needed,)
            nx = None
        else:
            calls = split_step(needed, cur, slots)
            nx = dict(zip(needed, nxt[i]))
        for call in calls:
            accesses += len(call)
            misses = 0
            for e in call:
                if e not in cur:
                    misses += 1
            hits += len(call) - misses
            # A resident expert this call needs has next use i; every other resident's
            # is > i (not needed at step i, or used by an earlier chunk of it), so the
            # heap's maximum is never a protected expert.
            for _ in range(misses - (slots - len(cur))):
                while True:
                    neg, v = pop(heap)
                    if cur.get(v) == -neg:
                        break
                del cur[v]
            for e, u in zip(call, nxt[i]) if nx is None else ((e, nx[e]) for e in call):
                cur[e] = u
                push(heap, (-u, e))
        if len(heap) > 2 * len(cur) + 64:
            heap = [(-u, e) for e, u in cur.items()]
            heapq.heapify(heap)
    return hits, accesses


# --------------------------------------------------------------------------- sweep


def _rate(h: int, n: int) -> float:
    return h / n if n else float("nan")


def simulate(
    trace_path,
    slots: list[int],
    policies: Iterable[str] = tuple(POLICIES),
    phase: Optional[str] = "decode",
) -> list[dict]:
    """Hit rates of every policy and of Belady at each slot count, over every sequence and
    layer of a trace file (per-layer pools, each sequence cold; hit rate = all hits / all
    accesses).

    One dict per requested slot count, in order::

        {"slots": 4, "requested_slots": 4, "experts": 8, "sequences": 4, "layers": 32,
         "accesses": 37336, "oversized_steps": 0,
         "hit_rate": {"lru": 0.611, "lfu": 0.603, "lfuda": 0.618}, "belady": 0.739,
         "gap_captured": {"lru": 0.0, "lfu": -0.07, "lfuda": 0.05}}

    ``gap_captured = (hit - lru_hit) / (belady_hit - lru_hit)``: the share of LRU's distance
    to the optimum a policy closes (None when that distance is 0). LRU is always simulated,
    as the baseline, and put first. A slot count above the number of experts is clamped to it.
    ``oversized_steps`` counts layer steps with more distinct experts than slots; where it is
    not 0, Belady is MIN under the engine's chunking, not a proven optimum.
    """
    slot_list = list(slots) if not isinstance(slots, int) else [slots]
    if not slot_list:
        raise ValueError("no slot counts given")
    checked = [_check_slots(s) for s in slot_list]
    names = list(dict.fromkeys(["lru", *policies]))
    for name in names:
        make_policy(name)  # ValueError for an unknown name, before any work
    seqs = load_trace(trace_path, phase=phase)
    if not seqs:
        raise ValueError(f"no {phase or 'routed'} sequences in trace file {os.fspath(trace_path)}")
    experts = max(s.experts for s in seqs)
    rows = []
    for requested in checked:
        s = min(requested, experts)
        hits = {name: 0 for name in names}
        opt = total = oversized = 0
        for seq in seqs:
            for steps in seq.layer_seqs:
                for name in names:
                    hits[name] += replay(steps, s, name)[0]
                h, n = belady(steps, s)
                opt += h
                total += n
                oversized += sum(1 for st in steps if st and len(set(st)) > s)
        rate = {name: _rate(h, total) for name, h in hits.items()}
        best = _rate(opt, total)
        gap = best - rate["lru"]
        rows.append(
            {
                "slots": s,
                "requested_slots": requested,
                "experts": experts,
                "sequences": len(seqs),
                "layers": max(q.layers for q in seqs),
                "accesses": total,
                "oversized_steps": oversized,
                "hit_rate": rate,
                "belady": best,
                "gap_captured": {
                    name: (None if gap == 0 or math.isnan(gap) else (r - rate["lru"]) / gap)
                    for name, r in rate.items()
                },
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    """A plain-text table of ``simulate`` rows: hit rate per policy and Belady, then the
    share of the LRU-to-Belady gap each non-LRU policy captures."""
    if not rows:
        return "(no results)"
    names = list(rows[0]["hit_rate"])
    others = [n for n in names if n != "lru"]
    head = ["slots", "frac"] + [n.upper() for n in names] + ["Belady"]
    head += [f"gap {n.upper()}" for n in others]
    body = []
    notes = []
    for r in rows:
        slot = str(r["slots"])
        if r.get("requested_slots", r["slots"]) != r["slots"]:
            slot += "*"
            notes.append(f"* {r['requested_slots']} slots clamped to {r['experts']} experts")
        cells = [slot, f"{r['slots'] / r['experts']:.2f}"]
        cells += [f"{r['hit_rate'][n]:.3f}" for n in names]
        cells.append(f"{r['belady']:.3f}")
        for n in others:
            g = r["gap_captured"].get(n)
            cells.append("-" if g is None else f"{g:+.0%}")
        body.append(cells)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in body]
    r0 = rows[0]
    lines.append(
        f"hit rate over {r0['accesses']:,} accesses ({r0['sequences']} sequences x "
        f"{r0['layers']} layers, per-layer pools, cold start); gap = share of the "
        f"LRU-to-Belady gap captured"
    )
    over = [r for r in rows if r.get("oversized_steps")]
    if over:
        lines.append(
            "Belady is MIN, not a proven optimum, at "
            + ", ".join(
                f"{r['slots']} slots ({r['oversized_steps']:,} steps exceed the pool)" for r in over
            )
        )
    lines += list(dict.fromkeys(notes))
    return "\n".join(lines)
