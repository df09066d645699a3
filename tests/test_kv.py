"""A quantized KV cache: the engine's output equals stock mlx-lm's with the same kv_bits,
at every pool size; chat turns reuse it; the planner sizes it."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import maybe_quantize_kv_cache, stream_generate
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache, trim_prompt_cache

from exactness import prompt_tokens, vocab_size
from llm_mlx_streaming.engine.kv import KVError, KVSpec, cache_bytes
from llm_mlx_streaming.engine.kv_window import FullPrecisionWindow
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.provider import EngineError
from llm_mlx_streaming.engine.planner import plan_memory
from llm_mlx_streaming.engine.request import Request

EXPERTS, TOP_K = 16, 4


@pytest.fixture
def qwen64(build):
    """Head dimension 64, so groups of 32 and 64 both apply."""
    return build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K, head_dim=64)


def stock_run(model, tokenizer, tokens, n, kv: KVSpec, cache=None):
    """(token ids, logprobs) of stock mlx-lm's stream_generate, greedy."""
    out = list(stream_generate(model, tokenizer, tokens, max_tokens=n, prompt_cache=cache, **kv.generate_kwargs()))
    return [r.token for r in out], [np.array(r.logprobs) for r in out]


def engine_run(engine, tokens, n, kv: KVSpec):
    out = list(engine.run(None, Request(prompt=list(tokens), max_tokens=n, kv=kv)))
    return [r.token for r in out], [np.array(r.logprobs) for r in out]


def same(a, b) -> bool:
    return a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("kv", [KVSpec(4, 64, 0), KVSpec(8, 32, 20)], ids=["4bit-g64", "8bit-g32-from20"])
def test_engine_equals_stock_mlx_lm_with_the_same_kv_bits_at_every_pool_size(qwen64, kv):
    model, tokenizer = mlx_load(str(qwen64))
    prompt = prompt_tokens(vocab_size(qwen64), n=48)
    expected = stock_run(model, tokenizer, prompt, 12, kv)
    assert not same(expected, stock_run(model, tokenizer, prompt, 12, KVSpec())), "kv_bits changed nothing"

    engine = EngineManager()
    for slots in (EXPERTS, EXPERTS // 2, TOP_K + 2, TOP_K):
        engine.load(qwen64, expert_slots=slots)
        engine.prompts.reset()
        assert same(engine_run(engine, prompt, 12, kv), expected), f"{slots} slots"
        stats = engine.last_stats
        assert stats["kv_bits"] == kv.bits and stats["kv_group_size"] == kv.group_size
        assert 0 < stats["kv_bytes"] and stats["ttft_seconds"] > 0 and stats["unplaced"] == 0
        assert all(isinstance(c, QuantizedKVCache) for c in engine.prompts.conversations()[-1][1])
    engine.unload()


def test_chat_turns_reuse_a_quantized_cache_as_stock_mlx_lm_does(qwen64):
    kv = KVSpec(4)
    model, tokenizer = mlx_load(str(qwen64))
    vocab = vocab_size(qwen64)
    prompt = prompt_tokens(vocab, n=40)
    engine = EngineManager()
    engine.load(qwen64, expert_slots=6)
    cache = make_prompt_cache(model)

    first = engine_run(engine, prompt, 8, kv)
    assert same(first, stock_run(model, tokenizer, prompt, 8, kv, cache))
    # the next turn extends the conversation: only its new tokens are prefilled
    extra = prompt_tokens(vocab, n=10, seed=3)
    second = engine_run(engine, prompt + first[0] + extra, 8, kv)
    assert engine.last_stats["reused_tokens"] == len(prompt) + 8
    assert engine.last_stats["prefilled_tokens"] == 10
    assert same(second, stock_run(model, tokenizer, extra, 8, kv, cache))
    # a turn that edits the last reply trims the quantized cache back to the common prefix
    other = prompt_tokens(vocab, n=6, seed=4)
    third = engine_run(engine, prompt + first[0][:3] + other, 8, kv)
    assert engine.last_stats["reused_tokens"] == len(prompt) + 3
    trim_prompt_cache(cache, cache[0].offset - (len(prompt) + 3))
    assert same(third, stock_run(model, tokenizer, other, 8, kv, cache))
    # another layout never reuses the quantized cache
    engine_run(engine, prompt + first[0] + extra, 4, KVSpec())
    assert engine.last_stats["reused_tokens"] == 0 and engine.last_stats["kv_bits"] is None
    assert engine.last_stats["reuse_note"] == "another KV layout"
    assert all(type(c) is KVCache for c in engine.prompts.conversations()[-1][1])
    engine.unload()


def test_the_planner_sizes_the_cache_a_long_prompt_really_fills(build):
    path = build("qwen3_moe", num_experts=8, top_k=2, head_dim=64, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=8192)
    context = 2100
    prompt = prompt_tokens(vocab_size(path), n=context - 10, seed=5)
    engine = EngineManager()
    engine.load(path, expert_slots=4)
    for kv in (KVSpec(4), KVSpec(8, 32), KVSpec()):
        engine.prompts.reset()
        list(engine.run(None, Request(prompt=prompt, max_tokens=10, kv=kv)))
        held = engine.last_stats["kv_bytes"]
        assert held == cache_bytes(engine.prompts.conversations()[-1][1]) > 0
        planned = plan_memory(path, "1GB", max_context=context, kv=kv).kv_bytes
        assert abs(planned - held) <= 0.05 * held, (kv, planned, held)
    engine.unload()


def test_a_quantized_plan_gives_the_pools_more_slots(build):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K, head_dim=64)
    big = plan_memory(path, "1GB", max_context=65536, reserve_bytes=0)
    budget = big.dense_bytes + big.kv_bytes + TOP_K * sum(big.expert_bytes_per_layer)  # the least that runs
    full = plan_memory(path, budget, max_context=65536, reserve_bytes=0)
    four = plan_memory(path, budget, max_context=65536, reserve_bytes=0, kv=KVSpec(4))
    assert full.slots_per_layer == [TOP_K, TOP_K]
    assert four.kv_bytes <= 0.3 * full.kv_bytes
    assert sum(four.slots_per_layer) > sum(full.slots_per_layer)
    assert four.kv_bits == 4 and "4-bit" in four.kv_description and full.kv_bits is None


@pytest.mark.parametrize("arch,why,shape", [
    ("gpt_oss", "sinks", {}),  # attends with sinks, which mlx-lm's quantized attention refuses
    ("phixtral", "values.dtype", {"head_dim": 32}),  # its code reads values.dtype off the cache
])
def test_models_that_cannot_quantize_fall_back_with_a_note(build, arch, why, shape):
    """The cache stays full precision, the output is stock's without kv_bits, and a note
    (the same in the plan) says why."""
    path = build(arch, num_experts=8, top_k=2, **shape)
    model, tokenizer = mlx_load(str(path))
    prompt = prompt_tokens(vocab_size(path), n=20)
    expected = stock_run(model, tokenizer, prompt, 6, KVSpec())
    engine = EngineManager()
    engine.load(path, expert_slots=4)
    assert same(engine_run(engine, prompt, 6, KVSpec(4, 32)), expected)
    stats = engine.last_stats
    assert stats["kv_bits"] is None and why in stats["kv_note"]
    assert why in plan_memory(path, "1GB", kv=KVSpec(4, 32)).kv_description
    engine.unload()


def test_a_group_that_does_not_divide_the_head_dimension_is_one_line(qwen64):
    engine = EngineManager()
    engine.load(qwen64, expert_slots=6)
    with pytest.raises(EngineError, match="kv_group_size 128 does not divide this model's head dimension 64"):
        list(engine.run(None, Request(prompt=[1, 2, 3], max_tokens=2, kv=KVSpec(4, 128))))
    assert engine.prompts.conversations() == []  # nothing was prefilled
    with pytest.raises(KVError, match="kv_bits must be off, 4 or 8, got 5"):
        KVSpec(5)
    engine.unload()


def test_sliding_windows_stay_full_precision_beside_quantized_layers():
    """mlx-lm cannot quantize a RotatingKVCache (it raises); a FullPrecisionWindow is
    passed by, and holds exactly what a RotatingKVCache holds."""
    rng = np.random.default_rng(0)
    full, window, reference = KVCache(), FullPrecisionWindow(16, 0), RotatingKVCache(16, 0)
    cache = [full, window]
    for n in (24, 1, 1):
        k, v = (mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32)) for _ in range(2))
        for c in cache + [reference]:
            got = c.update_and_fetch(k, v)
            if c is window:
                got_window = got
            if c is reference:
                want = got
        assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(got_window, want))
        maybe_quantize_kv_cache(cache, 0, 64, 4)
        assert isinstance(cache[0], QuantizedKVCache) and cache[1] is window
    with pytest.raises(NotImplementedError):
        maybe_quantize_kv_cache([reference], 0, 64, 4)


def test_quantized_caches_and_windows_survive_mlx_lm_save_and_load(tmp_path):
    """What a conversation cache on disk needs: mlx-lm's save/load keeps a quantized
    cache bit for bit, and a FullPrecisionWindow comes back as one."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from llm_mlx_streaming.engine.kv import after_loading, for_saving, same_layout

    rng = np.random.default_rng(1)
    cache = [KVCache(), FullPrecisionWindow(16, 0)]
    k = mx.array(rng.standard_normal((1, 2, 40, 64)).astype(np.float32))
    for c in cache:
        c.update_and_fetch(k, k)
    maybe_quantize_kv_cache(cache, 0, 64, 4)
    save_prompt_cache(str(tmp_path / "c.safetensors"), for_saving(cache))
    loaded = after_loading(load_prompt_cache(str(tmp_path / "c.safetensors")), [KVCache(), FullPrecisionWindow(16, 0)])
    assert [type(c) for c in loaded] == [QuantizedKVCache, FullPrecisionWindow]
    assert same_layout(loaded, [KVCache(), FullPrecisionWindow(16, 0)])
    assert not same_layout(loaded, [KVCache(), RotatingKVCache(16, 0)])
    for a, b in zip(cache, loaded):
        assert a.offset == b.offset
        assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(_arrays(a), _arrays(b)))


def _arrays(cache) -> list:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(cache.state) if isinstance(v, mx.array)]


def test_a_later_process_continues_a_quantized_conversation_from_disk(qwen64, tmp_path):
    """The conversation cache on disk keeps a quantized cache: a fresh engine loads it
    (its key includes the KV layout) and continues exactly as the engine that made it."""
    from llm_mlx_streaming.engine.disk_cache import DiskCacheSpec

    disk = DiskCacheSpec(tmp_path / "kv", 10**9)
    kv = KVSpec(4)
    vocab = vocab_size(qwen64)
    prompt, extra = prompt_tokens(vocab, n=40), prompt_tokens(vocab, n=10, seed=3)

    def run(engine, tokens, layout=kv):
        out = list(engine.run(None, Request(prompt=tokens, max_tokens=8, kv=layout, conversation_cache=disk)))
        return [r.token for r in out], [np.array(r.logprobs) for r in out]

    first_engine, later = EngineManager(), EngineManager()
    first_engine.load(qwen64, expert_slots=6)
    later.load(qwen64, expert_slots=6)
    first = run(first_engine, prompt)
    assert first_engine.last_stats["disk_cache_saved_bytes"] > 0
    follow = prompt + first[0] + extra
    continued = run(later, follow)
    assert later.last_stats["disk_cache_tokens"] == len(prompt) + 8
    assert isinstance(later.prompts.conversations()[-1][1][0], QuantizedKVCache)
    assert same(continued, run(first_engine, follow))  # the engine that kept it in memory
    # a layout the file was not made under never loads it
    fresh = EngineManager()
    fresh.load(qwen64, expert_slots=6)
    run(fresh, follow, KVSpec(8))
    assert fresh.last_stats["disk_cache_tokens"] == 0
    for engine in (first_engine, later, fresh):
        engine.unload()
