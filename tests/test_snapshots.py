"""An agent's prompt is read once on caches that cannot be rewound (#46): a new session
resumes from the snapshot at the end of the shared system prompt, in memory (after a
side request too) and from the conversation cache on disk after a restart, with the
tokens and log-probabilities of a cold prefill."""

from __future__ import annotations

import numpy as np
import pytest

from exactness import prompt_tokens, vocab_size
from llm_mlx_streaming.engine.disk_cache import DiskCacheSpec
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.request import Request
from llm_mlx_streaming.engine.snapshots import INTERVAL, SYSTEM, TURNS, Boundary, SnapshotSpec, positions

SYSTEM_END = 40
ARCHS = {  # one per class of cache that cannot be rewound, and plain attention
    "qwen3_next": dict(),  # linear attention beside full attention
    "gpt_oss": dict(),  # a sliding window (16 tokens) that wraps inside the system prompt
    "qwen3_moe": dict(),  # plain attention: trimmed in place, no snapshot needed
}
SPEC = SnapshotSpec(every=0, max_count=8, max_bytes=10**9)


def _request(tokens, disk=None, snapshots=SPEC, prefill_step=None):
    return Request(prompt=list(tokens), max_tokens=6, conversation_cache=disk, snapshots=snapshots,
                   boundaries=(Boundary(SYSTEM_END, SYSTEM),), prefill_step=prefill_step)


def _run(engine, request):
    out = engine.run(None, request)
    responses = list(out)
    return [r.token for r in responses], [np.array(r.logprobs) for r in responses], out.stats


def _same(a, b) -> bool:
    return a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_path(request, build):
    return request.param, build(request.param, num_experts=8, top_k=2, **ARCHS[request.param])


def test_a_new_session_resumes_at_the_shared_system_prompt_with_a_cold_prefills_tokens(arch_path, tmp_path):
    arch, path = arch_path
    vocab = vocab_size(path)
    system = prompt_tokens(vocab, n=SYSTEM_END, seed=1)
    first, second, side = (system + prompt_tokens(vocab, n=20, seed=s) for s in (2, 3, 4))
    third = system + prompt_tokens(vocab, n=12, seed=5)
    disk = DiskCacheSpec(tmp_path / "kv", 10**9)
    warm, cold = EngineManager(), EngineManager()
    warm.load(path, expert_slots=4)
    cold.load(path, expert_slots=4)

    _run(warm, _request(first, disk))
    resumed = _run(warm, _request(second, disk))
    cold.prompts.reset()
    assert _same(resumed, _run(cold, _request(second)))
    stats = resumed[2]
    assert stats["reused_tokens"] == SYSTEM_END
    assert stats["reused_from"] == ("memory" if arch == "qwen3_moe" else "snapshot")

    _run(warm, _request(prompt_tokens(vocab, n=30, seed=6), disk))  # an unrelated side request
    after_side = _run(warm, _request(third, disk))
    cold.prompts.reset()
    assert _same(after_side, _run(cold, _request(third)))
    assert after_side[2]["reused_tokens"] == SYSTEM_END
    assert after_side[2]["reused_from"] == ("memory" if arch == "qwen3_moe" else "snapshot")  # the side request evicted no conversation

    restarted = EngineManager()  # a new process: only the conversation cache on disk is left
    restarted.load(path, expert_slots=4)
    from_disk = _run(restarted, _request(side, disk))
    assert _same(from_disk, resumed if side == second else _run(cold, _request(side)))
    assert (from_disk[2]["reused_tokens"], from_disk[2]["reused_from"]) == (SYSTEM_END, "disk")


def test_without_snapshots_such_a_cache_says_why_it_read_the_prompt_again(build):
    path = build("qwen3_next", num_experts=8, top_k=2)
    vocab = vocab_size(path)
    system = prompt_tokens(vocab, n=SYSTEM_END, seed=1)
    engine = EngineManager()
    engine.load(path, expert_slots=4)
    _run(engine, _request(system + prompt_tokens(vocab, n=20, seed=2), snapshots=None))
    stats = _run(engine, _request(system + prompt_tokens(vocab, n=20, seed=3), snapshots=None))[2]
    assert stats["reused_tokens"] == 0
    assert stats["reuse_note"] == f"no snapshot inside the {SYSTEM_END} tokens shared"


def test_a_batch_member_takes_the_same_snapshots_as_a_request_alone(build):
    path = build("qwen3_next", num_experts=8, top_k=2)
    vocab = vocab_size(path)
    system = prompt_tokens(vocab, n=SYSTEM_END, seed=1)
    batched, alone = EngineManager(), EngineManager()
    batched.load(path, expert_slots=4)
    alone.load(path, expert_slots=4)
    for engine, max_batch in ((batched, 4), (alone, 1)):
        first = _request(system + prompt_tokens(vocab, n=20, seed=2))
        first.max_batch = max_batch
        _run(engine, first)
    assert batched.prompts.snapshot_count == alone.prompts.snapshot_count == 1
    second = _request(system + prompt_tokens(vocab, n=20, seed=3))
    second.max_batch = 4
    stats = _run(batched, second)[2]
    assert (stats["reused_tokens"], stats["reused_from"]) == (SYSTEM_END, "snapshot")


def test_snapshot_positions_are_the_boundaries_and_every_nth_token_inside_the_new_part():
    marks = (Boundary(40, SYSTEM), Boundary(130, TURNS))
    assert positions(0, 140, marks, 0) == [(40, SYSTEM), (130, TURNS)]
    assert positions(40, 140, marks, 50) == [(50, INTERVAL), (100, INTERVAL), (130, TURNS)]
    assert positions(0, 100, marks, 40) == [(40, SYSTEM), (80, INTERVAL)]
    assert positions(130, 140, marks, 50) == []


def test_a_thinking_templates_next_turn_rereads_only_the_reply_whose_reasoning_it_dropped(build):
    from llm.parts import Message, TextPart

    from fixtures.families import chat_format
    from llm_mlx_streaming.prompt.messages import assistant_message
    from llm_mlx_streaming.prompt.render import render_prompt
    from test_plugin_features import _tokenizer

    path = build("qwen3_next", num_experts=8, top_k=2, tokenizer_kind="bpe32k", chat_format=chat_format("qwen3"))
    tokenizer = _tokenizer(path)

    def said(role, text):
        return Message(role=role, parts=[TextPart(text=text)])

    first = [said("system", "You are a careful assistant. " * 12), said("user", "What is a B-tree?")]
    second = [*first, assistant_message("A balanced search tree.", reasoning="The user asks about B-trees. " * 8),
              said("user", "And a B+ tree?")]
    (tokens1, _, marks1), (tokens2, _, marks2) = (render_prompt(tokenizer, m, thinking=True) for m in (first, second))
    turns = next(b.position for b in marks1 if b.kind == TURNS)
    assert tokens2[:turns] == tokens1[:turns]

    engine, cold = EngineManager(), EngineManager()
    engine.load(path, expert_slots=4)
    cold.load(path, expert_slots=4)

    def ask(manager, tokens, marks):
        return _run(manager, Request(prompt=tokens, max_tokens=6, snapshots=SPEC, boundaries=marks))

    ask(engine, tokens1, marks1)
    held = engine.prompts.conversations()[-1][0]  # the prompt and the reply as generated, reasoning and all
    assert held != tokens2[:len(held)]  # the template rewrote the reply: no strict prefix to extend
    warm = ask(engine, tokens2, marks2)
    assert (warm[2]["reused_tokens"], warm[2]["reused_from"]) == (turns, "snapshot")
    assert len(tokens1) - turns <= 4  # all but the generation prompt's few tokens
    assert _same(warm, ask(cold, tokens2, marks2))


def test_snapshots_stay_within_their_count_and_bytes(build):
    path = build("qwen3_next", num_experts=8, top_k=2)
    vocab = vocab_size(path)
    engine = EngineManager()
    engine.load(path, expert_slots=4)
    every = SnapshotSpec(every=8, max_count=3, max_bytes=10**9)
    for seed in range(4):
        _run(engine, _request(prompt_tokens(vocab, n=50, seed=seed), snapshots=every))
        assert engine.prompts.snapshot_count <= 3
    one = engine.prompts.snapshot_bytes // engine.prompts.snapshot_count
    small = SnapshotSpec(every=8, max_count=100, max_bytes=int(2.5 * one))
    for seed in range(4):
        _run(engine, _request(prompt_tokens(vocab, n=50, seed=seed), snapshots=small))
        assert engine.prompts.snapshot_bytes <= small.max_bytes


def test_a_cache_no_layer_of_which_grows_keeps_its_snapshot_segment_on_disk_across_turns(build, tmp_path):
    path = build("longcat_flash_ngram", num_experts=8, top_k=2, head_dim=32)  # every layer a fixed state
    vocab = vocab_size(path)
    system = prompt_tokens(vocab, n=SYSTEM_END, seed=1)
    disk = DiskCacheSpec(tmp_path / "kv", 10**9)
    engine = EngineManager()
    engine.load(path, expert_slots=4)
    first = system + prompt_tokens(vocab, n=20, seed=2)
    reply = _run(engine, _request(first, disk))[0]
    _run(engine, _request(first + reply + prompt_tokens(vocab, n=8, seed=3), disk))  # the next turn extends it
    restarted = EngineManager()
    restarted.load(path, expert_slots=4)
    stats = _run(restarted, _request(system + prompt_tokens(vocab, n=20, seed=4), disk))[2]
    assert (stats["reused_tokens"], stats["reused_from"]) == (SYSTEM_END, "disk")
