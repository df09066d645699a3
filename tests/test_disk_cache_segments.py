"""The conversation cache on disk as segments (#18): a response writes only what its
turn added, a later process loads the chain back exactly, on every kind of cache
mlx-lm makes (plain and quantized attention, sliding windows, linear attention)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exactness import prompt_tokens, vocab_size
from llm_mlx_streaming.engine.disk_cache import DiskCacheSpec
from llm_mlx_streaming.engine.kv import KVSpec
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.request import Request

CASES = {  # arch, checkpoint overrides, KV layout, the turn that writes whole again
    "qwen3_moe": ("qwen3_moe", dict(), KVSpec(), None),
    "qwen3_moe-kv4": ("qwen3_moe", dict(quant="4bit", head_dim=64), KVSpec(4, 64, 0), None),
    # quantized from token 52: the first turn's cache (48) is plain, the second's replaces
    # every attention layer by a quantized one, so its write starts a new chain
    "qwen3_moe-kv4-from52": ("qwen3_moe", dict(quant="4bit", head_dim=64), KVSpec(4, 64, 52), 1),
    "gpt_oss-window16": ("gpt_oss", dict(), KVSpec(), None),  # sliding-window layers beside full attention
    "qwen3_next": ("qwen3_next", dict(), KVSpec(), None),  # linear-attention state beside full attention
}


def _files(root) -> list:
    return sorted((p for p in root.glob("*/*.safetensors") if not p.name.startswith(".")),
                  key=lambda p: int(p.name.split("-")[0]))


def _meta(path) -> dict:
    data = path.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return {k.split(".")[-1]: v for k, v in header["__metadata__"].items()}


def _run(engine, tokens, kv, disk):
    out = list(engine.run(None, Request(prompt=list(tokens), max_tokens=8, kv=kv, conversation_cache=disk)))
    return [r.token for r in out], [np.array(r.logprobs) for r in out]


@pytest.mark.parametrize("case", list(CASES))
def test_three_turns_from_segments_equal_the_conversation_kept_in_memory(build, tmp_path, case):
    arch, overrides, kv, whole_at = CASES[case]
    path = build(arch, num_experts=8, top_k=2, **overrides)
    vocab = vocab_size(path)
    disk = DiskCacheSpec(tmp_path / "kv", 10**9)
    memory, later = EngineManager(), EngineManager()
    memory.load(path, expert_slots=4)
    later.load(path, expert_slots=4)

    tokens, chain = prompt_tokens(vocab, n=40), []
    for turn in range(3):
        later.prompts.reset()  # each turn a new process: the cache comes from disk
        warm = _run(later, tokens, kv, disk)
        cold = _run(memory, tokens, kv, None)
        assert warm[0] == cold[0] and all(np.array_equal(a, b) for a, b in zip(warm[1], cold[1])), f"turn {turn + 1}"
        stats = later.last_stats
        if turn:
            assert stats["disk_cache_tokens"] == stats["reused_tokens"] == int(chain[-1].name.split("-")[0])
        files = _files(tmp_path / "kv")
        meta = _meta(files[-1])
        if turn in (0, whole_at):  # a first segment; the chain it extends is replaced
            chain = [files[-1]]
            assert meta["parent"] == "" and set(json.loads(meta["layers"])) <= {None, 0}
        else:
            assert meta["parent"] == chain[-1].name
            chain.append(files[-1])
        assert files == chain and stats["disk_cache_saved_bytes"] == files[-1].stat().st_size
        assert len(json.loads(meta["token_ids"])) == len(tokens) + 8 - (stats["reused_tokens"] if meta["parent"] else 0)
        tokens = tokens + warm[0] + prompt_tokens(vocab, n=10, seed=turn + 1)
    starts = [json.loads(_meta(f)["layers"]) for f in chain]
    assert len(starts) == (3 if whole_at is None else 3 - whole_at)  # turn 3 loaded two segments, or one
    # the attention layers of a later segment hold its own range, the bounded states all of theirs
    end = int(chain[-2].name.split("-")[0])
    assert {s for s in starts[-1] if s is not None} == {end}
    assert (None in starts[-1]) == (arch in ("gpt_oss", "qwen3_next"))
    if case == "qwen3_moe":
        assert chain[2].stat().st_size < chain[0].stat().st_size / 2
    for engine in (memory, later):
        engine.unload()


def test_a_turn_without_the_disk_cache_makes_the_next_write_whole(build, tmp_path):
    """What the cache holds was changed by a turn the conversation cache did not see,
    so no segment of the old chain is trusted to match it."""
    path = build("qwen3_moe", num_experts=8, top_k=2)
    disk = DiskCacheSpec(tmp_path / "kv", 10**9)
    engine = EngineManager()
    engine.load(path, expert_slots=4)
    tokens = prompt_tokens(vocab_size(path), n=40)
    first = _run(engine, tokens, KVSpec(), disk)[0]
    tokens = tokens + first + [5, 6, 7]
    second = _run(engine, tokens, KVSpec(), None)[0]
    _run(engine, tokens + second + [8, 9], KVSpec(), disk)
    latest = _files(tmp_path / "kv")[-1]
    assert _meta(latest)["parent"] == "" and set(json.loads(_meta(latest)["layers"])) == {0}
    engine.unload()


def test_the_conversation_cache_keeps_no_dropped_cache_alive(build, tmp_path):
    """It knows each conversation's cache by weak references: a cache the prompt cache
    drops (evicted, or all of it forgotten) is freed at once."""
    import gc
    import weakref

    path = build("qwen3_moe", num_experts=8, top_k=2)
    engine = EngineManager()
    engine.load(path, expert_slots=4)
    _run(engine, prompt_tokens(vocab_size(path), n=40), KVSpec(), DiskCacheSpec(tmp_path / "kv", 10**9))
    layer = weakref.ref(engine.prompts.conversations()[-1][1][0])
    engine.prompts.reset()
    gc.collect()
    assert layer() is None
    engine.unload()
