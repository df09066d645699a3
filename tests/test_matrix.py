"""Every MoE architecture of the installed mlx-lm streams exactly, or is refused with a reason.

The architectures are found in mlx-lm at test time (checkpoints/support.py), and each is
built from its own ModelArgs by the factory, so a module a new mlx-lm adds runs here at
once: it passes, or fails until the factory learns it or UNSUPPORTED names why not.
"""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from mlx_lm.utils import load_model

from exactness import greedy_tokens, prompt_tokens, vocab_size
from llm_mlx_streaming.checkpoints.config import check_checkpoint, moe_shape
from llm_mlx_streaming.checkpoints.support import UNSUPPORTED, moe_modules
from llm_mlx_streaming.engine.kv import KVSpec
from llm_mlx_streaming.engine.loading import load_streaming
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.prefill import TiledMixer, tile_mixers
from llm_mlx_streaming.engine.request import Request
from llm_mlx_streaming.errors import CheckpointError
from test_prefill import same, stock_run

EXPERTS, TOP_K = 8, 2
MODULES = moe_modules()
SUPPORTED = [m for m in MODULES if m not in UNSUPPORTED]
POOLS = {"all": None, "top-k": TOP_K, "2": 2}
# Each architecture once, the pool sizes taking turns, so every size meets many families.
SLICE = [(arch, list(POOLS)[i % len(POOLS)]) for i, arch in enumerate(SUPPORTED)]
CLI_PROMPT = "Tell me about tea"
DOCS = Path(__file__).parent.parent / "docs" / "architecture.md"


def test_the_enumeration_finds_mlx_lm_moe_modules_and_only_those():
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "dbrx", "qwen3_vl_moe"} <= set(MODULES)
    assert not {"llama", "qwen3", "switch_layers", "base"} & set(MODULES)
    stale = set(UNSUPPORTED) - set(MODULES)
    assert not stale, f"UNSUPPORTED names modules this mlx-lm does not have: {stale}"


def test_the_docs_table_is_the_unsupported_table():
    text = DOCS.read_text()
    section = text.split("## Unsupported architectures", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|$", section, re.M)
    assert dict(rows) == UNSUPPORTED


@pytest.mark.parametrize("arch,pool", SLICE)
def test_each_architecture_gives_stock_greedy_tokens(build, arch, pool):
    path = build(arch, num_experts=EXPERTS, top_k=TOP_K)
    stock, config = load_model(path)
    prompt = prompt_tokens(config["vocab_size"], n=24)
    expected = greedy_tokens(stock, prompt, n=12)
    loaded = load_streaming(path, expert_slots=POOLS[pool])
    try:
        assert loaded.pools, f"{arch}: no expert container was made to stream"
        assert greedy_tokens(loaded.model, prompt, n=12) == expected
        if pool == "2":
            assert sum(p.counters.evictions for p in loaded.pools) > 0
    finally:
        loaded.store.close()


@pytest.mark.parametrize("arch,pool", SLICE)
def test_each_architecture_through_llm_gives_stock_text_cold_from_disk_and_in_process(
        build, tmp_path, monkeypatch, arch, pool):
    """`llm -m mlx-stream/ARCH` three times: cold, then from the conversation cache on
    disk (a new process has no KV in memory), then reusing the in-process KV."""
    from mlx_lm import generate, load

    from llm_mlx_streaming.engine.manager import get_manager
    from plugin_support import LlmEnv, split_reply

    path = build(arch, num_experts=EXPERTS, top_k=TOP_K)
    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": CLI_PROMPT}], add_generation_prompt=True)
    expected = split_reply(generate(model, tokenizer, prompt, max_tokens=12), tokenizer)[0] + "\n"
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    env = LlmEnv(tmp_path, path)
    entry = {"path": str(path)} | ({"expert_slots": POOLS[pool]} if POOLS[pool] else {})
    env.write_settings(models={arch: entry})
    outs = []
    for forget in (True, True, False):
        if forget and get_manager().prompts is not None:
            get_manager().prompts.reset()
        result = env.run("-m", f"mlx-stream/{arch}", CLI_PROMPT, "-o", "max_tokens", "12")
        assert result.exit_code == 0, (result.output, result.exception)
        outs.append(result.stdout)
    assert outs == [expected] * 3
    stats = [t["stats"] for t in env.turns()]
    assert not stats[0].get("disk_cache_tokens") and not stats[0].get("reused_tokens")


@pytest.mark.parametrize("arch,field", [("ernie4_5_moe", "moe_k"), ("step3p5", "moe_top_k"),
                                        ("kimi_linear", "num_experts_per_token")])
def test_experts_per_token_is_read_as_mlx_lm_reads_it(build, arch, field):
    path = build(arch, num_experts=EXPERTS, top_k=3)
    config = check_checkpoint(path)  # the old key list refused these
    assert config[field] == 3 and moe_shape(config) == (EXPERTS, 3)


def test_a_top_k_mlx_lm_cannot_route_with_is_refused(build, tmp_path):
    copy = tmp_path / "bad"
    shutil.copytree(build("ernie4_5_moe", num_experts=EXPERTS, top_k=TOP_K), copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "moe_k": EXPERTS + 1}))
    with pytest.raises(CheckpointError, match=f"between 1 and the {EXPERTS} experts"):
        check_checkpoint(copy)


@pytest.mark.parametrize("arch", ["hunyuan", "gemma4_text"])  # a shared KV: positional, keyword
def test_a_long_prompt_through_attention_taking_more_arguments(build, arch):
    path = build(arch, num_experts=EXPERTS, top_k=TOP_K)
    prompt = prompt_tokens(vocab_size(path), n=80, seed=3)
    stock, _ = load_model(path)
    expected = stock_run(stock, prompt, 64)
    loaded = load_streaming(path, expert_slots=TOP_K + 1)
    try:
        tile_mixers(loaded.model, 16)
        assert same(stock_run(loaded.model, prompt, 64), expected)
    finally:
        loaded.store.close()


def test_the_tiled_path_passes_on_what_it_does_not_use(build):
    seen = []

    class Attention:
        def __call__(self, x, mask=None, cache=None, shared=None, *, position=None):
            seen.append((x.shape[1], shared, position))
            return x

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    tiled = TiledMixer(Attention(), tile=4)
    x = mx.zeros((1, 10, 8))
    tiled(x, "causal", KVCache(), None, position=None)  # nothing set: tiled
    assert [n for n, _, _ in seen] == [4, 4, 2]
    seen.clear()
    tiled(x, "causal", KVCache(), "kv", position=7)  # set: passed on, whole
    assert seen == [(10, "kv", 7)]


def test_kv_bits_4_equals_stock_quantized_cache_on_a_generic_family(build):
    path = build("dots1", num_experts=EXPERTS, top_k=TOP_K, head_dim=64)
    prompt = prompt_tokens(vocab_size(path), n=40, seed=4)
    stock, _ = load_model(path)
    expected = stock_run(stock, prompt, 64, kv=KVSpec(4))
    assert not any(map(np.isnan, expected[1][0]))
    engine = EngineManager()
    engine.load(path, expert_slots=2)
    try:
        assert same(engine_run(engine, prompt, 64, kv=KVSpec(4)), expected)
    finally:
        engine.unload()


def test_add_refuses_an_unsupported_architecture_in_one_line(llm_env, tmp_path):
    from plugin_support import assert_one_line_error

    copy = tmp_path / "Dbrx"
    shutil.copytree(llm_env.checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "dbrx"}))
    before = llm_env.settings_file.read_text()
    assert_one_line_error(llm_env.run("mlxs", "add", str(copy)), "dbrx is not supported",
                          UNSUPPORTED["dbrx"])
    assert llm_env.settings_file.read_text() == before


# -- each feature once, on families the feature's own tests do not build ------------


@pytest.mark.parametrize("arch,pool", [("qwen3_5_moe", "all"), ("glm4_moe_lite", "top-k"),
                                       ("exaone_moe", "2")])  # linear+full; MLA mask; window+full
def test_a_long_prompt_takes_the_tiled_path_at_every_pool_size(build, arch, pool):
    path = build(arch, num_experts=EXPERTS, top_k=TOP_K)
    prompt = prompt_tokens(vocab_size(path), n=80, seed=5)
    stock, _ = load_model(path)
    expected = stock_run(stock, prompt, 64)
    engine = EngineManager()
    engine.load(path, expert_slots=POOLS[pool])
    try:
        assert tile_mixers(engine.loaded.model, 16).wrapped > 0
        assert same(engine_run(engine, prompt, 64), expected)
    finally:
        engine.unload()


def test_k_3_ngram_speculation_gives_stock_greedy_tokens(build):
    path = build("minimax", num_experts=EXPERTS, top_k=TOP_K)
    stock, _ = load_model(path)
    start = prompt_tokens(vocab_size(path), n=4, seed=1)
    prompt = start + greedy_tokens(stock, start, n=2) + start  # a repeat the drafter finds
    engine = EngineManager()
    engine.load(path, expert_slots=2)
    try:
        generation = engine.run(None, Request(prompt=prompt, max_tokens=10, k=3, draft="ngram"))
        out = list(generation)
        assert [r.token for r in out] == greedy_tokens(stock, prompt, n=10)
        assert generation.stats["draft_tokens"] > 0 and not generation.stats["speculation_off"]
        assert all(np.isfinite(np.array(r.logprobs)).all() for r in out)  # readable off the engine thread
    finally:
        engine.unload()


def engine_run(engine, prompt, step, n=6, kv=KVSpec(), disk=None):
    out = list(engine.run(None, Request(prompt=prompt, max_tokens=n, prefill_step=step, kv=kv,
                                        conversation_cache=disk)))
    return [r.token for r in out], [np.array(r.logprobs) for r in out]


def _turns(path, disk, slots=2):
    """(turn 2 from the disk cache in a new engine, the same turn cold, the later stats)."""
    prompt = prompt_tokens(vocab_size(path), n=24, seed=6)
    first, later, cold = EngineManager(), EngineManager(), EngineManager()
    for engine in (first, later, cold):
        engine.load(path, expert_slots=slots)
    try:
        reply = engine_run(first, prompt, None, n=8, disk=disk)[0]
        follow = prompt + reply + prompt[:10]
        return (engine_run(later, follow, None, n=8, disk=disk), engine_run(cold, follow, None, n=8),
                first.last_stats, later.last_stats)
    finally:
        for engine in (first, later, cold):
            engine.unload()


def test_a_hybrid_model_continues_from_the_conversation_cache_on_disk(build, tmp_path):
    from llm_mlx_streaming.engine.disk_cache import DiskCacheSpec

    path = build("nemotron_h", num_experts=EXPERTS, top_k=TOP_K)  # mamba state + attention KV
    warm, cold, _, stats = _turns(path, DiskCacheSpec(tmp_path / "kv", 10**9))
    assert stats["disk_cache_tokens"] == 24 + 8
    assert warm[0] == cold[0]


def test_a_cache_class_mlx_lm_cannot_load_back_is_not_saved(build, tmp_path, capfd):
    from llm_mlx_streaming.engine.disk_cache import DiskCacheSpec

    path = build("deepseek_v41", num_experts=EXPERTS, top_k=TOP_K)
    warm, cold, first, _ = _turns(path, DiskCacheSpec(tmp_path / "kv", 10**9))
    assert "LayerCache" in first["disk_cache_error"] and "disk_cache_saved_bytes" not in first
    assert not list((tmp_path / "kv").rglob("*.safetensors"))
    assert same(warm, cold)
    assert "removed" not in capfd.readouterr().err
