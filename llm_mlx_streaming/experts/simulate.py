"""Replay recorded expert-routing traces through the pool's eviction policies.

A trace is a JSON-lines file, one routed sequence (one prompt's decode, or one prefill) per
line, the same format as the shared Mixtral trace so one reader serves both:

    {"model": "...", "layers": 32, "experts": 8, "top_k": 2, "phase": "decode",
     "layer_seqs": [[[6, 5], [3, 1], ...], ...]}

``layer_seqs[l][t]`` is the list of expert ids layer ``l`` routed to at step ``t``, in
router-rank order (highest gate first); a step may be ``null`` (not recorded: skipped). Lines
without ``layer_seqs`` but with the step-major ``steps[t][l]`` (the shared prefill line) are
read too. Other fields are kept as metadata.

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
import json
import math
import operator
import os
from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Optional

from .policies import POLICIES, make_policy

Step = Optional[list[int]]  # expert ids in router-rank order; None = not recorded
PHASES = ("decode", "prefill")


@dataclass
class Sequence:
    """One trace line: the routed experts of every layer, step by step."""

    layers: int
    experts: int
    top_k: int
    phase: str
    layer_seqs: list[list[Step]]  # [layer][step] -> expert ids or None
    model: Optional[str] = None
    meta: dict[str, Any] = field(default_factory=dict)  # the line's other fields

    @property
    def steps(self) -> int:
        return max((len(s) for s in self.layer_seqs), default=0)


# --------------------------------------------------------------------------- trace I/O


def _to_int_list(step, where: str) -> Step:
    if step is None:
        return None
    if hasattr(step, "tolist"):  # numpy / mlx arrays
        step = step.tolist()
    try:
        out = [int(e) for e in step]
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: a step must be a list of expert ids or null, got {step!r}"
        ) from None
    return out


def write_trace_line(
    fh: IO[str],
    *,
    model: Optional[str],
    layers: int,
    experts: int,
    top_k: int,
    phase: str,
    layer_seqs: Iterable[Iterable[Any]],
) -> None:
    """Append one sequence to an open text trace file (one JSON object, one line).

    ``layer_seqs[l][t]`` is the expert ids of layer ``l`` at step ``t`` in router-rank order
    (lists, tuples, or numpy/mlx arrays), or None for a step that was not recorded.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    seqs = [
        [_to_int_list(s, f"layer {li} step {t}") for t, s in enumerate(layer)]
        for li, layer in enumerate(layer_seqs)
    ]
    if len(seqs) != int(layers):
        raise ValueError(f"layer_seqs has {len(seqs)} layers, expected layers={layers}")
    obj = {
        "model": model,
        "layers": int(layers),
        "experts": int(experts),
        "top_k": int(top_k),
        "phase": phase,
        "layer_seqs": seqs,
    }
    fh.write(json.dumps(obj, separators=(",", ":")) + "\n")


def _parse_line(obj: Any, where: str) -> Sequence:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    try:
        layers = int(obj["layers"])
        experts = int(obj["experts"])
        top_k = int(obj["top_k"])
        phase = obj["phase"]
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{where}: layers, experts and top_k must be integers") from None
    if layers < 1 or experts < 1 or top_k < 1:
        raise ValueError(f"{where}: layers, experts and top_k must be >= 1")
    if "layer_seqs" in obj:
        raw = obj["layer_seqs"]
        if not isinstance(raw, list) or not all(isinstance(x, list) for x in raw):
            raise ValueError(f"{where}: layer_seqs must be a list (per layer) of lists (per step)")
    elif "steps" in obj:  # step-major steps[t][l] (the shared prefill line)
        steps = obj["steps"]
        if not isinstance(steps, list) or not all(
            isinstance(s, list) and len(s) == layers for s in steps
        ):
            raise ValueError(f"{where}: steps must be a list (per step) of {layers} entries")
        raw = [[s[li] for s in steps] for li in range(layers)]
    else:
        raise ValueError(f"{where}: missing field 'layer_seqs'")
    if len(raw) != layers:
        raise ValueError(f"{where}: layer_seqs has {len(raw)} layers, the line says {layers}")
    layer_seqs = []
    for li, layer in enumerate(raw):
        out = []
        for t, s in enumerate(layer):
            if s is not None and not isinstance(s, list):
                raise ValueError(f"{where}: layer {li} step {t} is not a list or null")
            step = _to_int_list(s, f"{where}: layer {li} step {t}")
            if step is not None and any(e < 0 or e >= experts for e in step):
                raise ValueError(
                    f"{where}: layer {li} step {t} has an expert id outside "
                    f"0..{experts - 1}: {step}"
                )
            out.append(step)
        layer_seqs.append(out)
    known = {"model", "layers", "experts", "top_k", "phase", "layer_seqs", "steps"}
    return Sequence(
        layers=layers,
        experts=experts,
        top_k=top_k,
        phase=phase,
        layer_seqs=layer_seqs,
        model=obj.get("model"),
        meta={k: v for k, v in obj.items() if k not in known and k != "layer_gating_probs"},
    )


def load_trace(path, phase: Optional[str] = "decode") -> list[Sequence]:
    """The sequences of one phase ("decode", "prefill"; None = all) in a trace file.

    Raises ValueError, naming the file, if it is missing, unreadable or malformed.
    """
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)} or None, got {phase!r}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"trace file not found: {path}")
    out: list[Sequence] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
                if isinstance(obj, dict) and phase is not None and obj.get("phase") != phase:
                    continue
                out.append(_parse_line(obj, where))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read trace file {path}: {e}") from None
    return out


# --------------------------------------------------------------------------- replay


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


def replay(steps: Iterable[Step], slots: int, policy_name: str) -> tuple[int, int]:
    """(hits, accesses) of one layer's step sequence through a cold pool of ``slots``
    slots evicting with ``policy_name`` (see ``policies.make_policy``).

    Each call does what ``ExpertPool.ensure`` does: the resident experts it needs are
    hits, recorded in router order; then each miss takes a free slot or evicts the
    policy's victim among the residents the call does not need (forgotten at once); then
    the misses are recorded, in router order. Accesses are distinct experts per call.
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
