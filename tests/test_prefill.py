"""A cold prompt reads each expert once: the prompt goes through the model in expert
chunks as large as memory allows, every mixer takes them in tiles of mlx-lm's chunk, and
the result is stock mlx-lm's own chunked prefill, bit for bit."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from exactness import prompt_tokens, vocab_size
from llm_mlx_streaming.engine.footprint import checkpoint_layout
from llm_mlx_streaming.engine.kv import KVSpec
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.planner import ATTENTION_TILE, expert_chunk, plan_memory, prefill_step_for
from llm_mlx_streaming.engine.prefill import TiledMixer, expert_chunks, tile_ends, tile_mixers
from llm_mlx_streaming.engine.request import Request
from llm_mlx_streaming.engine.snapshots import SYSTEM, Boundary, SnapshotSpec
from llm_mlx_streaming.experts import switch

EXPERTS, TOP_K, TILE = 16, 4, 64


def stock_run(model, prompt, step, n=6, kv=KVSpec()):
    out = list(generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=step, **kv.generate_kwargs()))
    return [t for t, _ in out], [np.array(l) for _, l in out]


def engine_run(engine, prompt, step, n=6, kv=KVSpec(), **fields):
    generation = engine.run(None, Request(prompt=prompt, max_tokens=n, prefill_step=step, kv=kv, **fields))
    out = list(generation)
    return [r.token for r in out], [np.array(r.logprobs) for r in out], generation.stats


def same(a, b) -> bool:
    return a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def mixer_calls(model) -> list:
    """The lengths every tiled mixer's own module is called with, from now on."""
    lengths = []
    for layer in model.layers:
        for child in layer.children().values():
            if isinstance(child, TiledMixer):
                inner = child.mixer
                child.mixer = lambda x, *a, inner=inner, **k: lengths.append(x.shape[1]) or inner(x, *a, **k)
    return lengths


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])  # a "causal" mask; an array mask (MLA)
@pytest.mark.parametrize("kv", [KVSpec(), KVSpec(4)], ids=["full", "4bit"])
def test_a_prompt_in_one_call_with_mixers_in_tiles_equals_stock_mlx_lm_chunks(build, arch, kv):
    if arch == "deepseek_v3" and kv.quantized:
        pytest.skip("MLA caches are not quantized (test_kv covers the fallback)")
    path = build(arch, quant="4bit", num_experts=EXPERTS, top_k=TOP_K, head_dim=64)
    prompt = prompt_tokens(vocab_size(path), n=300, seed=2)
    stock, _ = load_model(path)
    expected = stock_run(stock, prompt, TILE, kv=kv)  # stock mlx-lm, chunks of a tile
    engine = EngineManager()
    engine.load(path, expert_slots=TOP_K + 2)
    assert tile_mixers(engine.loaded.model, TILE).limit is None
    lengths = mixer_calls(engine.loaded.model)
    got = engine_run(engine, prompt, 512, kv=kv)
    assert same(got, expected)
    assert got[2]["prefill_calls"] == 1 and max(lengths) == TILE  # one model call, mixers a tile at a time
    engine.unload()


@pytest.mark.parametrize("arch", ["qwen3_next", "gpt_oss", "nemotron_h"])  # linear attention; a window; SSM
def test_every_kind_of_mixer_takes_one_call_in_tiles_and_snapshots_cost_no_call(build, arch):
    path = build(arch, num_experts=EXPERTS, top_k=TOP_K)
    prompt = prompt_tokens(vocab_size(path), n=200, seed=7)
    stock, _ = load_model(path)
    expected = stock_run(stock, prompt, TILE)
    engine = EngineManager()
    engine.load(path, expert_slots=2)
    tile_mixers(engine.loaded.model, TILE)
    spec = SnapshotSpec(every=0, max_count=8, max_bytes=10**9)
    marks = dict(snapshots=spec, boundaries=(Boundary(TILE, SYSTEM),))  # a snapshot where a tile ends
    got = engine_run(engine, prompt, 1024, **marks)
    assert same(got, expected)
    assert got[2]["prefill_calls"] == 1 and got[2]["snapshots_taken"] == 1
    assert got[2]["expert_passes"] <= 1.5  # one pass for the prompt, the last token's and one decode step's reads
    # a prompt that shares the snapshot's prefix resumes from it and computes what a cold one computes
    again = prompt[:TILE] + prompt_tokens(vocab_size(path), n=90, seed=8)
    resumed = engine_run(engine, again, 1024, **marks)
    assert resumed[2]["reused_from"] == "snapshot" and resumed[2]["reused_tokens"] == TILE
    assert same(resumed, stock_run(stock, again, TILE))
    engine.unload()


def test_a_cold_prompt_passes_over_the_experts_once_and_small_chunks_many_times(build):
    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K, head_dim=64, num_layers=3)
    prompt = prompt_tokens(vocab_size(path), n=512, seed=6)
    engine = EngineManager()
    engine.load(path, expert_slots=EXPERTS // 4)  # 25% resident
    tile_mixers(engine.loaded.model, TILE)
    passes, mb = {}, {}
    for step in (64, 512):
        engine.prompts.reset()
        stats = engine_run(engine, prompt, step, n=1)[2]
        passes[step], mb[step] = stats["expert_passes"], stats["prefill_mb_read"]
        assert stats["prefill_step"] == step and stats["unplaced"] == 0
        assert stats["prefill_calls"] == -(-(len(prompt) - 1) // step)
    assert passes[512] <= 1.3 and passes[64] >= 5, passes  # 8 calls read the experts 8 times, one call once
    assert mb[512] * 4 <= mb[64], mb
    engine.unload()


def test_a_long_call_computes_a_bounded_part_of_its_routes_at_once(build, monkeypatch):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K, num_layers=2)
    prompt = prompt_tokens(vocab_size(path), n=150, seed=3)
    stock, _ = load_model(path)
    expected = stock_run(stock, prompt, 2048)
    monkeypatch.setattr(switch, "ROUTES_AT_ONCE", 100)
    seen = []
    apply = switch.StreamingExperts._apply
    monkeypatch.setattr(switch.StreamingExperts, "_apply",
                        lambda self, x, slots, s: seen.append(x.shape[0]) or apply(self, x, slots, s))
    for slots in (None, EXPERTS // 2):  # every expert resident; half of them
        engine = EngineManager()
        engine.load(path, expert_slots=slots)
        seen.clear()
        assert same(engine_run(engine, prompt, 2048), expected)
        assert seen and max(seen) <= 100  # 149 x 4 routes a layer, never more than 100 at once
        engine.unload()


def test_the_next_expert_group_is_read_while_one_computes_and_the_result_is_exact(build):
    path = build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K, head_dim=64, num_layers=2)
    prompt = prompt_tokens(vocab_size(path), n=200, seed=4)
    stock, _ = load_model(path)
    expected = stock_run(stock, prompt, 2048)
    engine = EngineManager()
    engine.load(path, expert_slots=4, overlap="on")
    got = engine_run(engine, prompt, 2048)
    assert same(got, expected)
    assert got[2]["prefetch_loads"] > 0 and got[2]["unplaced"] == 0
    assert got[2]["expert_passes"] <= 1.6
    assert all(pool.bad_slots() == 0 for pool in engine.loaded.pools)
    engine.unload()


def test_a_prefill_stops_between_expert_groups_once_cancelled(build):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K, num_layers=3)
    prompt = prompt_tokens(vocab_size(path), n=300, seed=5)
    engine = EngineManager()
    engine.load(path, expert_slots=2)  # 8 groups of experts a layer
    groups = []
    generation = engine.run(None, Request(prompt=prompt, max_tokens=2, prefill_step=2048))

    def counted():
        groups.append(1)
        if len(groups) == 3:
            generation.cancel()

    stepping = engine.running.stepping
    original = stepping.between_groups
    stepping.between_groups = lambda out: (counted(), original(out))
    with pytest.raises(Exception):
        list(generation)
    assert len(groups) == 3  # the one call stopped at its third group, not at its end
    stepping.between_groups = original
    out = list(engine.run(None, Request(prompt=prompt, max_tokens=2)))  # the pools are whole again
    assert len(out) == 2 and all(pool.bad_slots() == 0 for pool in engine.loaded.pools)
    engine.unload()


def test_tiles_end_at_marks_and_calls_group_tiles_up_to_the_chunk():
    assert tile_ends(0, 10, 4, []) == [4, 8, 10]
    assert tile_ends(0, 10, 4, [6]) == [4, 6, 10]  # counted again from a mark
    assert tile_ends(3, 10, 4, [3, 12]) == [7, 10]
    assert expert_chunks([4, 8, 10], 0, 100) == [[4, 8, 10]]
    assert expert_chunks([4, 8, 10], 0, 8) == [[4, 8], [10]]
    assert expert_chunks([4, 8, 10], 0, 3) == [[4], [8], [10]]  # a tile alone when longer


def test_the_expert_chunk_is_what_the_room_left_by_the_prompt_holds(build):
    path = build("qwen3_moe", num_experts=EXPERTS, top_k=TOP_K, head_dim=64, max_position_embeddings=65536)
    layout = checkpoint_layout(path)
    chunk = expert_chunk(layout, 10**9, max_context=65536, fused=True)  # a GB beside the KV cache
    short, long = chunk.tokens(4000), chunk.tokens(65536)
    assert short >= long >= ATTENTION_TILE and short % ATTENTION_TILE == 0
    assert short == 65536 and chunk.passes(4000) == 1  # the whole context fits: one pass
    tight = expert_chunk(layout, 256 * 2**20, max_context=65536, fused=False)
    assert tight.tokens(65536) == ATTENTION_TILE  # never below mlx-lm's chunk
    assert tight.tokens(65536, held=10**9) == ATTENTION_TILE
    cpu = expert_chunk(layout, 10**9, max_context=65536, fused=False)
    assert cpu.tokens(60000) < chunk.tokens(60000)  # a tile's scores against the prompt count on the CPU
    some = expert_chunk(layout, 150 * 2**20, max_context=65536, fused=True)
    assert ATTENTION_TILE < some.tokens(8000, held=10**8) < some.tokens(8000)  # others' caches take room
    plan = plan_memory(path, "20GB", max_context=65536)
    assert plan.expert_chunk.room == plan.reserve_bytes + plan.unused_bytes  # the budget beyond the plan too
    auto = prefill_step_for(path, "20GB", max_context=65536)
    assert auto.tokens(4000) == Request(prompt=[1], prefill_step=auto).chunk(4000) == 65536
