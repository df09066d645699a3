"""Reads overlapping compute and reads ahead (experts/prefetch.py): never a changed
token, never an evicted expert a call needs, never a lost or half-read slot."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from mlx_lm.utils import load_model

from exactness import greedy_tokens, logits_trace, prompt_tokens, vocab_size
from fixtures.factory import ARCHITECTURES, supported_quants
from llm_mlx_streaming.engine.loading import load_streaming
from llm_mlx_streaming.experts.prefetch import Overlap
from llm_mlx_streaming.engine.provider import EngineError, ModelProvider
from llm_mlx_streaming.experts import prefetch, switch
from llm_mlx_streaming.experts.pool import ExpertPool
from test_faults import assert_pool_sound, interrupt_each_line

EXPERTS, TOP_K, SLOTS = 16, 4, 6
MOE_ARCHS = [a for a in ARCHITECTURES if a != "qwen3"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_overlap_and_read_ahead_on_are_exact_at_every_pool_size(build, arch):
    quant = supported_quants(arch)[0]
    path = build(arch, quant=quant, num_experts=EXPERTS, top_k=TOP_K)
    stock, config = load_model(path)
    prompt = prompt_tokens(config["vocab_size"])
    expected = greedy_tokens(stock, prompt)
    _, ref_decode = logits_trace(stock, prompt, expected)
    for slots in (2, TOP_K, EXPERTS):
        loaded = load_streaming(path, expert_slots=slots, overlap="on")
        try:
            tokens = greedy_tokens(loaded.model, prompt)
            _, decode = logits_trace(loaded.model, prompt, tokens)
            c = [p.counters for p in loaded.pools]
            assert tokens == expected, f"{slots} slots"
            assert all(np.array_equal(g, w) for g, w in zip(decode, ref_decode)), f"{slots} slots"
            assert sum(x.unplaced for x in c) == 0
            assert sum(p.bad_slots() for p in loaded.pools) == 0
            assert sum(x.prefetch_hits for x in c) <= sum(x.prefetch_loads for x in c)
            linked = any(m.ahead is not None for m in loaded.layers)
            if slots == TOP_K and linked:
                assert sum(x.prefetch_loads for x in c) > 0, "nothing was read ahead"
                assert sum(x.overlapped for x in c) > 0
        finally:
            loaded.store.close()


def test_every_factory_moe_layer_after_the_first_has_a_router_to_predict_with(build):
    missing = []
    for arch in MOE_ARCHS:
        path = build(arch, quant=supported_quants(arch)[0], num_experts=EXPERTS, top_k=TOP_K)
        loaded = load_streaming(path, expert_slots=TOP_K)
        try:
            if len(loaded.layers) > 1 and any(m.ahead is None for m in loaded.layers[:-1]):
                missing.append(arch)
        finally:
            loaded.store.close()
    assert not missing


def test_a_read_ahead_never_evicts_what_a_running_call_or_the_prediction_needs(build, monkeypatch):
    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K, num_layers=4)
    running: dict[int, set] = {}  # pool -> experts of its call in progress
    checked = []
    call, start = switch.StreamingExperts.__call__, ExpertPool.start_prefetch

    def tracked_call(self, x, indices, *args, **kwargs):
        running[id(self.pool)] = {int(e) for e in np.array(indices).reshape(-1)}
        try:
            return call(self, x, indices, *args, **kwargs)
        finally:
            running.pop(id(self.pool), None)

    def tracked_start(self, predicted, keep=()):
        before = {int(e) for e in self.expert_in if e >= 0}
        n = start(self, predicted, keep)
        evicted = before - {int(e) for e in self.expert_in if e >= 0}
        assert not evicted & ({int(e) for e in predicted} | {int(e) for e in keep})
        if not len(keep):  # a read ahead for the next layer (within a prompt's call: the group in flight is `keep`)
            assert not evicted & running.get(id(self), set())
        checked.append(len(evicted))
        return n

    monkeypatch.setattr(switch.StreamingExperts, "__call__", tracked_call)
    monkeypatch.setattr(ExpertPool, "start_prefetch", tracked_start)
    loaded = load_streaming(path, expert_slots=TOP_K + 1, overlap="on")
    try:
        greedy_tokens(loaded.model, prompt_tokens(vocab_size(path), n=24), 16)
        assert sum(checked) > 0, "no read ahead had to evict"
        assert sum(p.counters.unplaced for p in loaded.pools) == 0
        for pool in loaded.pools:
            assert_pool_sound(pool)
    finally:
        loaded.store.close()


def _full_pool(path) -> tuple:
    loaded = load_streaming(path, expert_slots=SLOTS)
    pool = loaded.pools[0]
    pool.ensure(np.arange(SLOTS))
    return loaded, pool


def test_a_read_ahead_lands_in_victims_slots_and_counts_its_hits(build):
    loaded, pool = _full_pool(build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K))
    try:
        assert pool.start_prefetch([SLOTS, SLOTS + 1, 0]) == 2
        assert pool.slot_of[SLOTS] < 0  # not published before it is settled
        pool.settle_prefetch()
        assert pool.slot_of[0] >= 0 and pool.slot_of[SLOTS] >= 0 and pool.slot_of[SLOTS + 1] >= 0
        assert (pool.counters.prefetch_loads, pool.counters.evictions) == (2, 2)
        misses = pool.counters.misses
        other = next(e for e in range(1, SLOTS) if pool.slot_of[e] >= 0)
        pool.ensure([SLOTS, 0, other])
        assert pool.counters.prefetch_hits == 1 and pool.counters.misses == misses
        assert_pool_sound(pool)
    finally:
        loaded.store.close()


@pytest.mark.parametrize("fault", [OSError("EIO"), KeyboardInterrupt()])
def test_a_read_ahead_that_fails_in_its_thread_frees_its_slots(build, fault):
    loaded, pool = _full_pool(build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K))
    try:
        read = pool._read

        def failing(targets):
            raise fault

        pool._read = failing
        pool.start_prefetch([SLOTS, SLOTS + 1])
        if isinstance(fault, KeyboardInterrupt):
            with pytest.raises(KeyboardInterrupt):
                pool.settle_prefetch()
        else:
            pool.settle_prefetch()  # the call that needs them reads them itself
        pool._read = read
        assert pool.slot_of[SLOTS] < 0 and pool.counters.prefetch_loads == 0
        assert_pool_sound(pool)
        pool.ensure([SLOTS, SLOTS + 1])
        assert_pool_sound(pool)
    finally:
        loaded.store.close()


def test_an_interrupt_at_any_step_of_a_read_ahead_loses_no_slot(build):
    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K)
    loaded, pool = _full_pool(path)
    try:
        rng = np.random.default_rng(2)

        def prepare():
            pool.ensure(np.arange(SLOTS))
            return rng.choice(np.arange(SLOTS, EXPERTS), TOP_K, replace=False)

        def step(predicted):
            try:
                pool.start_prefetch(predicted)
                pool.settle_prefetch()
            finally:
                pool.settle_prefetch()  # what an interrupted start left in flight

        interrupted = interrupt_each_line(pool, prepare, step)
        assert interrupted > 10
    finally:
        loaded.store.close()


def _drop(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        f.read_bytes()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and mincore as on Linux")
def test_auto_overlaps_where_reads_wait_on_the_disk_and_not_where_the_page_cache_serves(build):
    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K, num_layers=3)
    prompt = prompt_tokens(vocab_size(path), n=16)
    runs = {}
    for regime, page_cache in (("disk", "bypass"), ("page cache", "keep")):
        _drop(path) if regime == "disk" else _warm(path)
        loaded = load_streaming(path, expert_slots=TOP_K + 1, page_cache=page_cache)
        try:
            assert loaded.overlap.mode == "auto"
            runs[regime] = greedy_tokens(loaded.model, prompt, 12)
            c = [p.counters for p in loaded.pools]
            overlapped, ahead = sum(x.overlapped for x in c), sum(x.prefetch_loads for x in c)
            if regime == "disk":
                assert overlapped > 0 and ahead > 0
            else:
                assert overlapped == 0 and ahead == 0
        finally:
            loaded.store.close()
    assert runs["disk"] == runs["page cache"]


def test_a_bad_overlap_is_one_line(build):
    with pytest.raises(ValueError) as e:
        Overlap("sometimes")
    assert str(e.value) == "overlap must be one of auto, on, off, got 'sometimes'"
    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K)
    with pytest.raises(EngineError) as e:
        ModelProvider().load(path, expert_slots=SLOTS, overlap="maybe")
    assert "\n" not in str(e.value) and "overlap" in str(e.value)


def test_overlap_changes_on_a_loaded_model_without_a_reload(build):
    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K)
    provider = ModelProvider()
    provider.load(path, expert_slots=SLOTS)
    try:
        loaded = provider.loaded
        provider.load(path, expert_slots=SLOTS, overlap="on")
        assert provider.loaded is loaded and loaded.overlap.mode == "on" == provider.overlap
        assert all(m.overlap is loaded.overlap for m in loaded.layers)
    finally:
        provider.unload()


def test_prediction_is_the_routers_top_k():
    import mlx.core as mx
    import mlx.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, EXPERTS, bias=False)

    block = Block()
    router = prefetch.find_router(block, EXPERTS)
    x = mx.random.normal((1, 1, 8))
    want = set(np.argsort(-np.array(block.gate(x)).reshape(-1))[:TOP_K])
    assert router.hidden == 8 and set(prefetch.predict(router, x, TOP_K)) == want


def test_a_router_one_module_down_is_found_and_its_extra_outputs_dropped():
    """`router.layer` (granitemoe), `gate.wg` (hunyuan), and a classifier with zero
    experts after the routed ones (longcat_flash): the scores of the routed experts."""
    import mlx.core as mx
    import mlx.nn as nn

    class Gate(nn.Module):
        def __init__(self, outputs):
            super().__init__()
            self.classifier = nn.Linear(8, outputs, bias=False)

    class Block(nn.Module):
        def __init__(self, outputs):
            super().__init__()
            self.router = Gate(outputs)
            self.up_proj = nn.Linear(8, 64, bias=False)  # not a router: no router/gate name

    x = mx.random.normal((1, 1, 8))
    for outputs in (EXPERTS, EXPERTS + 3):
        block = Block(outputs)
        router = prefetch.find_router(block, EXPERTS)
        scores = np.array(block.router.classifier(x)).reshape(-1)[:EXPERTS]
        assert router.hidden == 8 and set(prefetch.predict(router, x, TOP_K)) == set(np.argsort(-scores)[:TOP_K])
    assert prefetch.find_router(Block(EXPERTS - 1), EXPERTS) is None
