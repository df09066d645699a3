"""Long prompts: large prefill chunks read each expert at most once per chunk, and
attention takes them in tiles; the result is stock mlx-lm's with the same chunks."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from exactness import prompt_tokens, vocab_size
from llm_mlx_streaming.engine.kv import KVSpec
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.planner import ATTENTION_TILE, PREFILL_STEP, plan_memory, prefill_step_for
from llm_mlx_streaming.engine.prefill import TiledAttention, tile_attention
from llm_mlx_streaming.engine.request import Request

EXPERTS, TOP_K, TILE = 16, 4, 64


def stock_run(model, prompt, step, n=6, kv=KVSpec()):
    out = list(generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=step, **kv.generate_kwargs()))
    return [t for t, _ in out], [np.array(l) for _, l in out]


def engine_run(engine, prompt, step, n=6, kv=KVSpec()):
    out = list(engine.run(None, Request(prompt=prompt, max_tokens=n, prefill_step=step, kv=kv)))
    return [r.token for r in out], [np.array(r.logprobs) for r in out]


def same(a, b) -> bool:
    return a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])  # a "causal" mask; an array mask (MLA)
@pytest.mark.parametrize("kv", [KVSpec(), KVSpec(4)], ids=["full", "4bit"])
def test_a_large_chunk_in_attention_tiles_equals_stock_mlx_lm(build, arch, kv):
    if arch == "deepseek_v3" and kv.quantized:
        pytest.skip("MLA caches are not quantized (test_kv covers the fallback)")
    path = build(arch, quant="4bit", num_experts=EXPERTS, top_k=TOP_K, head_dim=64)
    prompt = prompt_tokens(vocab_size(path), n=300, seed=2)
    stock, _ = load_model(path)
    expected = stock_run(stock, prompt, 256, kv=kv)
    engine = EngineManager()
    engine.load(path, expert_slots=TOP_K + 2)
    longest = []
    for attention in engine.loaded.model.layers:
        tiled = attention.self_attn
        assert isinstance(tiled, TiledAttention)
        inner = tiled.attention
        tiled.attention = lambda x, mask, cache, inner=inner: longest.append(x.shape[1]) or inner(x, mask, cache)
    tile_attention(engine.loaded.model, TILE)
    assert same(engine_run(engine, prompt, 256, kv=kv), expected)
    assert max(longest) == TILE  # a 256-token chunk went through attention 64 tokens at a time
    if not kv.quantized:  # and attention in tiles is exactly stock's chunks of a tile
        assert same(expected, stock_run(stock, prompt, TILE))
    engine.unload()


def test_each_expert_is_read_at_most_once_per_chunk_and_large_chunks_read_less(build):
    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K, head_dim=64, num_layers=3)
    prompt = prompt_tokens(vocab_size(path), n=512, seed=6)
    engine = EngineManager()
    engine.load(path, expert_slots=EXPERTS // 4)  # 25% resident
    tile_attention(engine.loaded.model, TILE)
    read = {}
    for step in (64, 512):
        engine.prompts.reset()
        before = [p.counters.misses for p in engine.loaded.pools]
        list(engine.run(None, Request(prompt=prompt, max_tokens=1, prefill_step=step)))
        misses = [p.counters.misses - b for p, b in zip(engine.loaded.pools, before)]
        chunks = -(-(len(prompt) - 1) // step) + 2  # the prefill chunks, the last prompt token, one decode step
        assert max(misses) <= chunks * EXPERTS, (step, misses)
        read[step] = engine.last_stats["mb_read"]
        assert engine.last_stats["prefill_step"] == step and engine.last_stats["unplaced"] == 0
    assert read[512] * 4 <= read[64], read  # 8 chunks read the experts 8 times, one chunk once
    engine.unload()


def test_auto_step_grows_with_the_budget_and_stays_in_bounds(build):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K, head_dim=64, max_position_embeddings=65536)
    small = prefill_step_for(path, "1GB", max_context=32768)
    large = prefill_step_for(path, "64GB", max_context=32768)
    assert small == PREFILL_STEP  # never below mlx-lm's default
    assert large == 32768  # never above the context
    assert prefill_step_for(path, "64GB", max_context=3000) == 3072
    mid = prefill_step_for(path, "20GB", max_context=32768)
    assert PREFILL_STEP <= mid <= large and mid % 256 == 0
    assert plan_memory(path, "20GB", max_context=32768).reserve_bytes > 0
    assert ATTENTION_TILE == PREFILL_STEP
