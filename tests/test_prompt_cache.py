"""One prompt cache per model, many conversations in it (#56): three agents interleaved,
Claude Code's main conversation after a side request and a subagent, and a batch of three
each resume their previous prompt from memory, on plain attention and on a cache that
cannot be rewound (linear attention), with the conversation cache on disk off or on; every
kind of reuse gives a cold prefill's tokens and log-probabilities; the conversations stay
within the KV cache the memory plan holds for the context, the least recently used going
first and coming back from disk."""

from __future__ import annotations

import numpy as np
import pytest

from exactness import prompt_tokens, vocab_size
from llm_mlx_streaming.engine.disk_cache import DiskCacheSpec
from llm_mlx_streaming.engine.kv import FULL_PRECISION
from llm_mlx_streaming.engine.manager import EngineManager
from llm_mlx_streaming.engine.request import Request
from llm_mlx_streaming.engine.snapshots import SYSTEM, TURNS, Boundary, SnapshotSpec

SYSTEM_TOKENS = 300  # an agent's own system prompt and tools
GENERATION = 3  # the generation prompt's tokens, which end every prompt here
SPEC = SnapshotSpec(every=0, max_count=16, max_bytes=10**9)


def _request(tokens, system=SYSTEM_TOKENS, disk=None, **fields):
    marks = (Boundary(system, SYSTEM), Boundary(len(tokens) - GENERATION, TURNS))
    return Request(prompt=list(tokens), max_tokens=4, conversation_cache=disk, snapshots=SPEC, boundaries=marks,
                   **fields)


def _run(engine, request):
    out = engine.run(None, request)
    responses = list(out)
    return [r.token for r in responses], [np.array(r.logprobs) for r in responses], out.stats


def _cold(engine, request):
    engine.prompts.reset()
    return _run(engine, request)


def _same(a, b) -> bool:
    return a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def path(request, build):
    return build(request.param, num_experts=8, top_k=2)


@pytest.fixture
def engines(path):
    warm, cold = EngineManager(), EngineManager()
    warm.load(path, expert_slots=4)
    cold.load(path, expert_slots=4)
    yield warm, cold
    warm.unload()
    cold.unload()


def _turn(vocab, seed, n=12):
    """A user turn's tokens and the generation prompt after them."""
    return prompt_tokens(vocab, n=n + GENERATION, seed=seed)


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory-only", "with-disk"])
def test_three_agents_interleaved_each_resume_their_previous_prompt_from_memory(path, engines, on_disk, tmp_path):
    warm, cold = engines
    vocab = vocab_size(path)
    disk = DiskCacheSpec(tmp_path / "kv", 10**9) if on_disk else None
    prompts = [prompt_tokens(vocab, n=SYSTEM_TOKENS, seed=10 + a) + _turn(vocab, 20 + a) for a in range(3)]
    held = [0, 0, 0]
    for turn in range(3):  # A1 B1 C1 A2 B2 C2 A3 B3 C3
        for agent in range(3):
            result = _run(warm, _request(prompts[agent], disk=disk))
            if turn:
                stats = result[2]
                assert (stats["reused_from"], stats["reused_tokens"]) == ("memory", held[agent]), (turn, agent)
                assert stats["disk_cache_tokens"] == 0
                assert _same(result, _cold(cold, _request(prompts[agent])))
            held[agent] = len(prompts[agent]) + len(result[0])
            prompts[agent] = prompts[agent] + result[0] + _turn(vocab, 30 + 3 * turn + agent)
    assert warm.prompts.conversation_count == 3


def test_claude_codes_main_conversation_resumes_from_memory_after_a_side_request_and_a_subagent(path, engines):
    warm, cold = engines
    vocab = vocab_size(path)
    main = prompt_tokens(vocab, n=SYSTEM_TOKENS, seed=1) + _turn(vocab, 2)
    side = prompt_tokens(vocab, n=40, seed=3) + _turn(vocab, 4)  # a title, on its own short system prompt
    subagent = prompt_tokens(vocab, n=200, seed=5) + _turn(vocab, 6, n=30)  # its own system prompt and tools
    reply = _run(warm, _request(main))[0]
    _run(warm, _request(side, system=40))
    found = _run(warm, _request(subagent, system=200))[0]
    following = main + reply + _turn(vocab, 7, n=40)  # a tool's result
    result = _run(warm, _request(following))
    assert (result[2]["reused_from"], result[2]["reused_tokens"]) == ("memory", len(main) + len(reply))
    assert _same(result, _cold(cold, _request(following)))
    again = _run(warm, _request(subagent + found + _turn(vocab, 8), system=200))  # the subagent's next turn
    assert (again[2]["reused_from"], again[2]["reused_tokens"]) == ("memory", len(subagent) + len(found))


def test_a_batch_of_three_conversations_each_resume_their_own_from_memory(path, engines):
    from test_batch import _queued_behind_a_held_job

    warm, cold = engines
    vocab = vocab_size(path)
    prompts = [prompt_tokens(vocab, n=SYSTEM_TOKENS, seed=40 + a) + _turn(vocab, 50 + a) for a in range(3)]
    handles = _queued_behind_a_held_job(warm, [_request(p, max_batch=3) for p in prompts])
    replies = [[r.token for r in h] for h in handles]
    assert [h.stats["batch"] for h in handles] == [3, 3, 3]
    assert warm.prompts.conversation_count == 3
    for prompt, reply, seed in zip(prompts, replies, range(60, 63)):
        following = prompt + reply + _turn(vocab, seed)
        result = _run(warm, _request(following))
        assert result[2]["reused_from"] == "memory" and result[2]["reused_tokens"] >= len(prompt) + len(reply) - 1
        assert _same(result, _cold(cold, _request(following)))


def test_a_rerendered_reply_takes_its_conversation_another_session_copies_the_system_prompt(path, engines):
    """A thinking template re-renders the last reply (without its reasoning): the next
    prompt holds all of the conversation's turns, so it continues it: the cache is cut back
    in place (plain attention) or resumed from the snapshot where the turns end, and the
    old conversation is gone. A new session sharing only the system prompt gets a copy of
    that part (or its snapshot) and leaves the conversation it came from."""
    warm, cold = engines
    vocab = vocab_size(path)
    system = prompt_tokens(vocab, n=SYSTEM_TOKENS, seed=70)
    first = system + _turn(vocab, 71)
    reply = _run(warm, _request(first))[0]
    other = system + _turn(vocab, 72)
    other[SYSTEM_TOKENS] = (first[SYSTEM_TOKENS] + 1) % vocab  # it diverges right after the system prompt
    result = _run(warm, _request(other))
    rewinds = warm.prompts.rewinds
    assert (result[2]["reused_from"], result[2]["reused_tokens"]) == (
        "memory" if rewinds else "snapshot", SYSTEM_TOKENS)
    assert result[2]["reuse_note"] == f"diverged at token {SYSTEM_TOKENS}"
    assert _same(result, _cold(cold, _request(other)))
    assert warm.prompts.conversation_count == 2

    rerendered = first + [(t + 1) % vocab for t in reply] + _turn(vocab, 73)
    result = _run(warm, _request(rerendered))
    turns = len(first) - GENERATION
    assert (result[2]["reused_from"], result[2]["reused_tokens"]) == (
        ("memory", len(first)) if rewinds else ("snapshot", turns))
    assert _same(result, _cold(cold, _request(rerendered)))
    held = [tokens for tokens, _ in warm.prompts.conversations()]
    assert len(held) == 2 and not any(t[:len(first) + 1] == first + reply[:1] for t in held)  # superseded


def test_conversations_stay_within_the_planned_kv_cache_the_least_recent_coming_back_from_disk(path, engines,
                                                                                              tmp_path):
    warm, cold = engines
    vocab = vocab_size(path)
    disk = DiskCacheSpec(tmp_path / "kv", 10**9)
    prompts = [prompt_tokens(vocab, n=SYSTEM_TOKENS, seed=80 + a) + _turn(vocab, 90 + a) for a in range(3)]
    one = warm.prompts.size(FULL_PRECISION, len(prompts[0]) + 4)
    context = next(n for n in range(len(prompts[0]), 10**5, 16) if warm.prompts.size(FULL_PRECISION, n) >= 2 * one)
    replies = []
    for prompt in prompts:  # the third request's cache leaves room for one other: A goes
        replies.append(_run(warm, _request(prompt, disk=disk, max_context=context))[0])
        assert warm.prompts.conversation_bytes <= warm.prompts.max_bytes == warm.prompts.size(FULL_PRECISION, context)
    assert [held[:len(prompts[0])] for held, _ in warm.prompts.conversations()] == prompts[1:]
    following = prompts[0] + replies[0] + _turn(vocab, 99)
    result = _run(warm, _request(following, disk=disk, max_context=context))
    assert (result[2]["reused_from"], result[2]["reused_tokens"]) == ("disk", len(prompts[0]) + len(replies[0]))
    assert _same(result, _cold(cold, _request(following)))


def test_the_plan_and_the_engine_ask_one_predicate_whether_a_cache_rewinds(build):
    from llm_mlx_streaming.engine.footprint import checkpoint_layout

    for arch, rewinds in (("qwen3_moe", True), ("qwen3_next", False), ("gpt_oss", False)):
        path = build(arch, num_experts=8, top_k=2)
        engine = EngineManager()
        engine.load(path, expert_slots=4)
        assert engine.prompts.rewinds is checkpoint_layout(path).rewinds is rewinds, arch
        engine.unload()
