"""Tests for the trace simulator (llm_mlx_streaming.experts.simulate)."""

from __future__ import annotations

import io
import json
import random
from functools import lru_cache
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from llm_mlx_streaming.experts import policies
from llm_mlx_streaming.experts.simulate import belady, format_table, replay, simulate, split_step
from llm_mlx_streaming.experts.traces import bundled_traces, load_trace, write_trace_line

MIXTRAL = bundled_traces()["mixtral-8x7b"]  # the real Mixtral trace, shipped (experts/recorded/NOTICE)
POLICY_NAMES = tuple(policies.POLICIES)


def write_trace(path: Path, lines: list[dict]) -> Path:
    with open(path, "w") as fh:
        for line in lines:
            write_trace_line(fh, **line)
    return path


def one_layer(layer_seq, experts, top_k=2, phase="decode"):
    return dict(model="t", layers=1, experts=experts, top_k=top_k, phase=phase, layer_seqs=[layer_seq])


def brute_force_optimum(steps, slots: int) -> int:
    """Most hits any choice of victims can get, trying every choice: the engine's calls
    (``split_step``: a step that does not fit the pool is chunked resident-first, so the
    chunks depend on what is resident), each needing its experts resident together; a
    miss with no free slot evicts any resident the call does not need."""
    steps = [s for s in steps if s]

    @lru_cache(maxsize=None)
    def step(i: int, cache: frozenset) -> int:
        if i == len(steps):
            return 0
        calls = tuple(tuple(c) for c in split_step(steps[i], cache, slots))
        return chunk(i, calls, 0, cache)

    @lru_cache(maxsize=None)
    def chunk(i: int, calls: tuple, j: int, cache: frozenset) -> int:
        if j == len(calls):
            return step(i + 1, cache)
        call = frozenset(calls[j])
        misses = call - cache
        must = max(0, len(cache) + len(misses) - slots)
        out = max(
            chunk(i, calls, j + 1, (cache - frozenset(evicted)) | misses)
            for evicted in combinations(sorted(cache - call), must)
        )
        return len(call & cache) + out

    return step(0, frozenset())


def random_steps(rng: random.Random, experts: int, top_k: int, n: int, skew: float = 1.0):
    weights = [1.0 / (i + 1) ** skew for i in range(experts)]
    steps = []
    for _ in range(n):
        chosen: list[int] = []
        while len(chosen) < top_k:
            e = rng.choices(range(experts), weights)[0]
            if e not in chosen:
                chosen.append(e)
        steps.append(chosen)
    return steps


# ----------------------------------------------------------------------------- hand counts


def test_lru_hand_count_with_protection():
    # 3 experts, 2 slots, LRU; the clock ticks at each record ("rec" = last use). As in
    # ExpertPool.ensure, a call records its hits first, then loads and records its misses.
    #   [0,1]  0, 1 miss into free slots                            res {0,1}  rec 0:1 1:2
    #   [2,0]  0 hit (rec 0:3). 2 misses with the pool full: 0 is the least recent before
    #          this call but the call needs it, so the victim is 1      res {0,2}  rec 2:4
    #   [1]    1 miss: victim = least recent of {0:3, 2:4} = 0         res {1,2}  rec 1:5
    #          (recording 2's load before 0's hit would have evicted 2 here instead)
    #   [2,1]  2 hit, 1 hit                                            rec 2:6 1:7
    #   [0]    0 miss: victim = least recent of {2:6, 1:7} = 2
    # hits: 0 + 1 + 0 + 2 + 0 = 3 of 2+2+1+2+1 = 8 accesses.
    steps = [[0, 1], [2, 0], [1], [2, 1], [0]]
    assert replay(steps, 2, "lru") == (3, 8)


def test_cyclic_trace_lru_is_suboptimal():
    # Top-1 cycle 0,1,2 x3 with 2 slots: LRU always evicts the expert needed next: 0 hits.
    # Belady: 0,1 cold; 2 evicts 1 (next use 4 > 3); 0 hit; 1 evicts 0 (6 > 5); 2 hit;
    # 0 evicts 2 (8 > 7); 1 hit; 2 miss  ->  3 hits of 9.
    steps = [[e] for e in [0, 1, 2] * 3]
    assert replay(steps, 2, "lru") == (0, 9)
    assert belady(steps, 2) == (3, 9)
    for name in POLICY_NAMES:
        assert belady(steps, 2)[0] >= replay(steps, 2, name)[0]
    assert brute_force_optimum(steps, 2) == 3


def test_null_and_empty_steps_are_skipped_and_duplicates_counted_once():
    steps = [[0, 1], None, [], [1, 1], [0]]
    assert replay(steps, 2, "lru") == (2, 4)
    assert belady(steps, 2) == (2, 4)


def test_split_step_fits_or_goes_resident_first():
    # fits: one call, distinct experts in router order
    assert split_step([3, 1, 3, 2], set(), 8) == [[3, 1, 2]]
    # too many: resident ones first (router order), then the rest, in calls of `slots`
    assert split_step([3, 1, 3, 2, 0], {2, 7}, 2) == [[2, 3], [1, 0]]
    assert split_step([4, 3, 2, 1, 0], {0, 3}, 2) == [[3, 0], [4, 2], [1]]


def test_chunked_long_steps_never_fail():
    # 5 distinct experts per step, 2 slots: each step becomes 3 calls; no call can be left
    # without a victim, for any policy.
    steps = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [0, 2, 4, 1, 3]]
    for name in POLICY_NAMES:
        h, n = replay(steps, 2, name)
        assert n == 15 and 0 <= h <= belady(steps, 2)[0]


# ----------------------------------------------------------------------------- Belady


def test_belady_beats_every_policy_on_random_traces():
    rng = random.Random(1234)
    for trial in range(40):
        experts = rng.randint(3, 16)
        top_k = rng.randint(1, min(4, experts))
        slots = rng.randint(top_k, experts)  # decode: every step fits the pool
        steps = random_steps(rng, experts, top_k, rng.randint(20, 150), skew=rng.random() * 1.5)
        opt, n = belady(steps, slots)
        for name in POLICY_NAMES:
            h, n2 = replay(steps, slots, name)
            assert n2 == n
            assert opt >= h, (trial, name, slots, experts, top_k)
        # can't beat "every first touch of an expert in a sequence misses"
        distinct = len({e for s in steps for e in s})
        assert opt <= n - distinct


def test_belady_equals_brute_force_on_tiny_traces():
    rng = random.Random(7)
    for trial in range(80):
        experts = rng.randint(2, 6)
        slots = rng.randint(1, min(4, experts))
        # steps of 1..slots distinct experts: all fit the pool
        steps = [rng.sample(range(experts), rng.randint(1, slots)) for _ in range(rng.randint(3, 9))]
        assert belady(steps, slots)[0] == brute_force_optimum(steps, slots), (trial, steps, slots)


def test_belady_is_not_a_bound_when_steps_exceed_the_pool():
    # Steps of 3 experts, 2 slots: each runs as two calls, resident experts first, so what
    # step 0 keeps decides how step 1 is split. MIN keeps 2 and 1 after step 0 (0 and 2
    # tie on next use); step 1 then runs [2,1] (2 hits) and loads 0 last, which must evict
    # one of the pair step 2 needs. LRU keeps 0 and 1, runs [0,1] + [2] and ends on {1,2}.
    steps = [[2, 0, 1], [0, 2, 1], [2, 1], [1, 2, 0]]
    assert replay(steps, 2, "lru") == (6, 11)
    assert belady(steps, 2) == (5, 11)
    assert brute_force_optimum(steps, 2) == 6


# ----------------------------------------------------------------------------- I/O, errors


def test_write_and_load_round_trip(tmp_path):
    dec = [[[0, 1], None, [np.int64(2), 3]], [np.array([3, 2]), [1, 0], []]]
    path = tmp_path / "t.jsonl"
    with open(path, "w") as fh:
        write_trace_line(fh, model="m", layers=2, experts=4, top_k=2, phase="decode", layer_seqs=dec)
        write_trace_line(fh, model="m", layers=2, experts=4, top_k=2, phase="prefill",
                         layer_seqs=[[[0, 1, 2]], [[3]]])
        write_trace_line(fh, model=None, layers=2, experts=4, top_k=2, phase="decode",
                         layer_seqs=[[(1, 0)], [(2, 3)]])
    assert all(len(line) > 0 for line in path.read_text().splitlines())
    seqs = load_trace(path)
    assert len(seqs) == 2
    s = seqs[0]
    assert (s.model, s.layers, s.experts, s.top_k, s.phase) == ("m", 2, 4, 2, "decode")
    assert s.layer_seqs == [[[0, 1], None, [2, 3]], [[3, 2], [1, 0], []]]
    assert seqs[1].model is None and seqs[1].layer_seqs == [[[1, 0]], [[2, 3]]]
    pre = load_trace(path, phase="prefill")
    assert len(pre) == 1 and pre[0].layer_seqs == [[[0, 1, 2]], [[3]]]
    assert len(load_trace(path, phase=None)) == 3


def test_load_step_major_lines(tmp_path):
    # the shared prefill line has steps[t][l] instead of layer_seqs[l][t]
    line = {"layers": 2, "experts": 4, "top_k": 1, "phase": "prefill",
            "steps": [[[0], [1]], [None, [2]], [[3], [3]]], "extra": 1}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (s,) = load_trace(path, phase="prefill")
    assert s.layer_seqs == [[[0], None, [3]], [[1], [2], [3]]]
    assert s.meta == {"extra": 1}


def test_write_trace_line_validates():
    with pytest.raises(ValueError, match="layers"):
        write_trace_line(io.StringIO(), model="m", layers=3, experts=4, top_k=1,
                         phase="decode", layer_seqs=[[[0]]])
    with pytest.raises(ValueError, match="phase"):
        write_trace_line(io.StringIO(), model="m", layers=1, experts=4, top_k=1,
                         phase="train", layer_seqs=[[[0]]])


def test_errors_name_the_file_or_value(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match="nope.jsonl"):
        load_trace(missing)
    with pytest.raises(ValueError, match="nope.jsonl"):
        simulate(missing, [2])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"layers": 1, "experts": 4, "top_k": 1, "phase": "decode", "layer_seqs": [[[0]]]}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_trace(bad)
    out_of_range = write_trace(tmp_path / "oor.jsonl", [one_layer([[0], [9]], experts=4)])
    with pytest.raises(ValueError, match=r"oor\.jsonl:1.*outside"):
        load_trace(out_of_range)
    no_field = tmp_path / "nf.jsonl"
    no_field.write_text('{"layers": 1, "experts": 4, "phase": "decode", "layer_seqs": [[[0]]]}\n')
    with pytest.raises(ValueError, match="top_k"):
        load_trace(no_field)
    good = write_trace(tmp_path / "good.jsonl", [one_layer([[0, 1], [2, 3]], experts=4)])
    for bad_slots in (0, -3):
        with pytest.raises(ValueError, match=str(bad_slots)):
            simulate(good, [2, bad_slots])
        with pytest.raises(ValueError, match=str(bad_slots)):
            replay([[0]], bad_slots, "lru")
        with pytest.raises(ValueError, match=str(bad_slots)):
            belady([[0]], bad_slots)
    with pytest.raises(ValueError, match="2.5"):
        simulate(good, [2.5])
    with pytest.raises(ValueError):
        simulate(good, [])
    with pytest.raises(ValueError, match="fifo"):
        simulate(good, [2], policies=("fifo",))
    with pytest.raises(ValueError, match="prefill"):
        simulate(good, [2], phase="prefill")  # no prefill lines in the file


# ----------------------------------------------------------------------------- simulate


def test_simulate_clamps_and_aggregates(tmp_path):
    rng = random.Random(3)
    lines = [
        dict(model="t", layers=2, experts=6, top_k=2, phase="decode",
             layer_seqs=[random_steps(rng, 6, 2, 40), random_steps(rng, 6, 2, 30)])
        for _ in range(3)
    ]
    path = write_trace(tmp_path / "t.jsonl", lines)
    rows = simulate(path, [3, 6, 50])
    assert [r["slots"] for r in rows] == [3, 6, 6]
    assert [r["requested_slots"] for r in rows] == [3, 6, 50]
    assert rows[1]["hit_rate"] == rows[2]["hit_rate"] and rows[1]["belady"] == rows[2]["belady"]
    # with every expert resident only cold misses remain
    cold = sum(len({e for s in layer for e in s}) for ln in lines for layer in ln["layer_seqs"])
    assert rows[2]["accesses"] == 3 * 70 * 2
    assert rows[2]["belady"] == pytest.approx(1 - cold / rows[2]["accesses"])
    assert rows[2]["gap_captured"] == {name: None for name in POLICY_NAMES}
    # aggregation = all hits / all accesses, each sequence and layer cold
    h = n = 0
    for ln in lines:
        for layer in ln["layer_seqs"]:
            a, b = replay(layer, 3, "lfu")
            h, n = h + a, n + b
    assert rows[0]["hit_rate"]["lfu"] == pytest.approx(h / n)
    r = rows[0]
    for name in POLICY_NAMES:
        assert r["belady"] >= r["hit_rate"][name]
        g = (r["hit_rate"][name] - r["hit_rate"]["lru"]) / (r["belady"] - r["hit_rate"]["lru"])
        assert r["gap_captured"][name] == pytest.approx(g)
    # LRU is always simulated (it is the baseline) and comes first
    assert list(simulate(path, [3], policies=("lfuda",))[0]["hit_rate"]) == ["lru", "lfuda"]


def test_format_table(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [one_layer([[0, 1], [2, 0], [1], [0, 2], [1, 2]] * 3, experts=3)])
    text = format_table(simulate(path, [1, 2, 3, 5]))
    lines = text.splitlines()
    assert "LRU" in lines[0] and "Belady" in lines[0] and "gap LFUDA" in lines[0]
    table = lines[:6]
    assert len({len(line) for line in table}) == 1  # aligned columns
    assert "-" in lines[5].split()  # gap is undefined when every expert fits
    assert "clamped" in text
    assert format_table([]) == "(no results)"


# ----------------------------------------------------------------------------- Mixtral trace

# README sanity numbers (LRU, LFU, Belady) at 2..6 slots of 8.
README = {2: (.318, .286, .460), 3: (.458, .444, .635), 4: (.589, .583, .751),
          5: (.697, .705, .834), 6: (.799, .810, .896)}

def flat(steps):
    """Each routed expert as its own call: the model the README's numbers use."""
    return [[e] for s in steps if s for e in s]


def test_mixtral_readme_numbers_flat_access_model(monkeypatch):
    # The README's sanity numbers come from a flat access stream: every routed expert is
    # its own request, so loading a token's 2nd expert may evict its 1st. Replaying that
    # stream (one expert per call) reproduces the README's LRU and Belady numbers.
    #
    # The README's LFU is a different LFU from ours: its counts persist after an eviction
    # (frequency since the start of the sequence), while ours (Vates') restart at 1 on
    # every load. Registering that variant reproduces .286/.444/.583/.705/.810; ours gives
    # .236/.386/.522/.653/.778 on the flat stream.
    class PersistentLFU(policies.LFU):
        name = "lfu_persistent"

        def forget(self, expert):
            policies.Policy.forget(self, expert)  # keep the count

    monkeypatch.setitem(policies.POLICIES, "lfu_persistent", PersistentLFU)
    seqs = load_trace(MIXTRAL)
    assert len(seqs) == 4
    for slots, (lru, lfu, opt) in README.items():
        tot = {"lru": 0, "lfu_persistent": 0, "belady": 0}
        n = 0
        for seq in seqs:
            for layer in seq.layer_seqs:
                steps = flat(layer)
                for name in ("lru", "lfu_persistent"):
                    tot[name] += replay(steps, slots, name)[0]
                h, k = belady(steps, slots)
                tot["belady"] += h
                n += k
        assert n == 37336
        assert abs(tot["lru"] / n - lru) < 0.005, slots
        assert abs(tot["lfu_persistent"] / n - lfu) < 0.005, slots
        assert abs(tot["belady"] / n - opt) < 0.005, slots


def test_decayed_lfu_remembers_evicted_experts_and_forgets_slowly():
    # 2 slots. Expert 0 is used 3 times, then the call [1, 2] must evict it. It comes
    # back (a miss, evicting 1), 2 is used once more, then 3 needs a slot: decayed-lfu
    # still counts 0's earlier uses (4 > 2) and evicts 2, so the last [0] hits; lfu's
    # count for 0 restarted at its reload (1 < 2), so it evicts 0 and misses it again.
    steps = [[0], [0], [0], [1, 2], [0], [2], [3], [0]]
    assert replay(steps, 2, "decayed-lfu") == (4, 9)
    assert replay(steps, 2, "lfu") == (3, 9)
    # halving: every HALF_LIFE x slots accesses all counts halve, so an old favourite is
    # overtaken by an expert used steadily since
    p = policies.make_policy("decayed-lfu", slots=1)
    assert p.period == policies.DecayedLFU.HALF_LIFE
    for _ in range(p.period - 1):
        p.record(5)
    p.record(6)  # the period's last access: every count halves
    assert p.count[5] == (p.period - 1) / 2 and p.count[6] == 0.5


def test_default_policy_measures_best_on_the_mixtral_trace():
    # docs/policies.md: the default is the policy with the highest hit rate at every slot
    # count where there is a choice (3..7 of 8).
    for r in simulate(MIXTRAL, [3, 4, 5, 6, 7]):
        best = max(r["hit_rate"], key=r["hit_rate"].get)
        assert best == policies.DEFAULT_POLICY, r


def test_mixtral_engine_model():
    # The engine's pool needs a token's top-2 experts resident together, so neither may
    # evict the other. With 2 slots that leaves no choice at all (every policy = Belady =
    # adjacent-token overlap). At 3..6 slots LRU is above the README's flat-stream numbers
    # (protection keeps it from evicting the token's other expert) and Belady below (the
    # oracle loses that option): LRU .495/.611/.712/.809, Belady .604/.739/.829/.894.
    rows = simulate(MIXTRAL, [2, 3, 4, 5, 6, 8])
    expected = {2: (.373, .373), 3: (.495, .604), 4: (.611, .739), 5: (.712, .829), 6: (.809, .894)}
    for r in rows:
        assert r["accesses"] == 37336 and r["oversized_steps"] == 0
        for name in POLICY_NAMES:
            assert r["belady"] >= r["hit_rate"][name] - 1e-12
        if r["slots"] in expected:
            lru, opt = expected[r["slots"]]
            assert abs(r["hit_rate"]["lru"] - lru) < 0.002
            assert abs(r["belady"] - opt) < 0.002
    assert len(set(rows[0]["hit_rate"].values())) == 1 and rows[0]["gap_captured"]["lfu"] is None
    assert rows[-1]["belady"] == rows[-1]["hit_rate"]["lru"]  # 8 of 8: only cold misses
