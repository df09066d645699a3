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

CASES = {
    "qwen3_moe": (dict(), KVSpec()),
    "qwen3_moe-kv4": (dict(quant="4bit", head_dim=64), KVSpec(4, 64, 0)),
    # quantized from token 52: the first turn's cache (48) is plain, later ones are not
    "qwen3_moe-kv4-from52": (dict(quant="4bit", head_dim=64), KVSpec(4, 64, 52)),
    "gpt_oss-window16": (dict(), KVSpec()),  # sliding-window layers beside full attention
    "qwen3_next": (dict(), KVSpec()),  # linear-attention state beside full attention
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
    arch = case.split("-")[0]
    overrides, kv = CASES[case]
    path = build(arch, num_experts=8, top_k=2, **overrides)
    vocab = vocab_size(path)
    disk = DiskCacheSpec(tmp_path / "kv", 10**9)
    memory, later = EngineManager(), EngineManager()
    memory.load(path, expert_slots=4)
    later.load(path, expert_slots=4)

    tokens = prompt_tokens(vocab, n=40)
    for turn in range(3):
        later.session.reset()  # each turn a new process: the cache comes from disk
        warm = _run(later, tokens, kv, disk)
        cold = _run(memory, tokens, kv, None)
        assert warm[0] == cold[0] and all(np.array_equal(a, b) for a, b in zip(warm[1], cold[1])), f"turn {turn + 1}"
        stats = later.last_stats
        files = _files(tmp_path / "kv")
        assert len(files) == turn + 1 and stats["disk_cache_saved_bytes"] == files[-1].stat().st_size
        if turn:
            assert stats["disk_cache_tokens"] == stats["reused_tokens"] == int(files[-2].name.split("-")[0])
            meta = _meta(files[-1])
            assert meta["parent"] == files[-2].name and len(json.loads(meta["token_ids"])) == len(tokens) + 8 - \
                stats["reused_tokens"]
        tokens = tokens + warm[0] + prompt_tokens(vocab, n=10, seed=turn + 1)
    # turn 3 loaded two segments; what each wrote holds its own range for the attention layers
    starts = [json.loads(_meta(f)["layers"]) for f in files]
    assert all(s in (None, 0) for s in starts[0])
    assert any(isinstance(s, int) and s > 0 for s in starts[2])
    if case == "qwen3_moe":
        assert files[2].stat().st_size < files[0].stat().st_size / 2
    if case.endswith("from52"):  # quantized since turn 2: written whole there, appended after
        assert set(starts[1]) == {0} and set(starts[2]) == {int(files[1].name.split("-")[0])}
    if arch in ("gpt_oss", "qwen3_next"):  # the bounded states are whole in every segment
        assert None in starts[1] and None in starts[2]
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
