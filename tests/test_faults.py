"""Faults injected into the expert reads: every one is a clean failure, never a lost
slot, a half-filled slot or a changed output afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from exactness import greedy_tokens, prompt_tokens, vocab_size
from llm_mlx_streaming.engine.loading import load_streaming
from llm_mlx_streaming.experts import policies, pool as pool_mod, store as store_mod

EXPERTS, TOP_K, SLOTS = 16, 4, 6
# The code an interrupt can land in while a pool makes experts resident.
TRACED = {Path(m.__file__).resolve() for m in (pool_mod, policies, store_mod)}


@pytest.fixture
def qwen(build):
    return build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K)


def assert_pool_sound(pool):
    """Every slot is free or holds exactly one expert whose bytes match the disk."""
    occupied = [s for s, e in enumerate(pool.expert_in) if e >= 0]
    for s in occupied:
        assert pool.slot_of[pool.expert_in[s]] == s
    assert sorted(occupied + list(pool._free)) == list(range(pool.slots))  # none lost
    assert int((pool.slot_of >= 0).sum()) == len(occupied)
    device = np.array(pool.device_map)
    for e in np.nonzero(pool.slot_of >= 0)[0]:
        assert device[e] == pool.slot_of[e]
    assert pool.verify() == 0


def interrupt_at_line(n: int):
    """A tracer that raises KeyboardInterrupt at the n-th line run in TRACED code."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        if Path(frame.f_code.co_filename).resolve() in TRACED:
            return local
        return None

    return tracer, seen


def test_an_interrupt_at_any_step_of_ensure_loses_no_slot(qwen):
    loaded = load_streaming(qwen, expert_slots=SLOTS)
    try:
        prompt = prompt_tokens(vocab_size(qwen), n=12)
        expected = greedy_tokens(loaded.model, prompt, 8)
        pool = loaded.pools[0]
        rng = np.random.default_rng(1)
        n, interrupted = 0, 0
        while True:
            n += 1
            # A full pool, so that the next call must evict (the bookkeeping is traced too).
            pool.ensure(np.arange(SLOTS))
            needed = rng.choice(np.arange(SLOTS, EXPERTS), TOP_K, replace=False)
            tracer, seen = interrupt_at_line(n)
            sys.settrace(tracer)
            try:
                pool.ensure(needed)
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                sys.settrace(None)
            assert_pool_sound(pool)
            if seen[0] < n:  # ensure finished before the n-th line: every step was hit
                break
            pool.ensure(needed)
            assert all(pool.slot_of[e] >= 0 for e in needed)
            assert_pool_sound(pool)
        assert interrupted > 20
        assert greedy_tokens(loaded.model, prompt, 8) == expected
        assert sum(p.verify() for p in loaded.pools) == 0
        assert sum(p.counters.unplaced for p in loaded.pools) == 0
    finally:
        loaded.store.close()
