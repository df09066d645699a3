"""`llm -m mlx-stream`: prompts, chat, continuation and logging through llm's real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import llm
import pytest

from plugin_support import assert_ok, mlx_lm_text, split_reply as _split


def test_prompt_matches_mlx_lm_and_is_logged(llm_env):
    result = assert_ok(
        llm_env.run("-m", "mlx-stream", "-s", "Be brief.", "-o", "max_tokens", "24", "Tell me about tea")
    )
    expected = mlx_lm_text(
        llm_env.checkpoint,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about tea"}],
        24,
    )
    text, _ = _split(expected)
    assert result.stdout == text + "\n"

    [turn] = llm_env.turns()
    stats = turn["stats"]
    assert turn["model"] == "mlx-stream"
    assert turn["resolved_model"] == str(llm_env.checkpoint)
    assert turn["input_tokens"] == stats["prompt_tokens"] > 0
    # (the engine may reuse a shared prefix left in its cache by an earlier test)
    assert stats["prompt_tokens"] == stats["reused_tokens"] + stats["prefilled_tokens"]
    assert turn["output_tokens"] == stats["generated_tokens"] == 24
    assert stats["expert_slots"] == 4 and stats["unplaced"] == 0
    assert stats["misses"] > 0 and stats["hits"] + stats["misses"] > 0
    assert stats["finish_reason"] == "length"


def test_chat_reuses_cache_and_matches_a_fresh_process(llm_env):
    result = assert_ok(
        llm_env.run(
            "chat", "-m", "mlx-stream/small", "-o", "max_tokens", "12",
            input="hello there\nhow are you\nquit\n",
        )
    )
    first, second = llm_env.turns()
    assert first["thread_id"] == second["thread_id"]
    s1, s2 = first["stats"], second["stats"]
    assert s2["reused_tokens"] == s1["prompt_tokens"] + s1["generated_tokens"]
    assert s2["prefilled_tokens"] == s2["prompt_tokens"] - s2["reused_tokens"]
    assert s2["prefilled_tokens"] < s2["prompt_tokens"] - s1["prompt_tokens"]

    # A fresh process continuing the same first turn gets the same reply
    # (`llm -c`: earlier turns come back from logs.db, the KV cache from the
    # conversation cache on disk that the first process saved).
    chat_reply = result.stdout.split("> how are you\n", 1)[1].rsplit("\n> quit", 1)[0]
    env = {**os.environ, "LLM_USER_PATH": str(llm_env.user_dir)}
    llm_bin = str(Path(sys.executable).parent / "llm")
    for args in (["-m", "mlx-stream/small", "hello there"], ["-c", "how are you"]):
        out = subprocess.run(
            [llm_bin, *args, "-o", "max_tokens", "12"],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
    assert out.stdout == chat_reply + "\n"
    fresh = llm_env.turns()[-1]
    first_fresh = llm_env.turns()[-2]
    reply_tokens = first_fresh["stats"]["prompt_tokens"] + first_fresh["stats"]["generated_tokens"]
    # (the chat's own saved cache shares even more of this prompt: it is cut back to it)
    assert fresh["stats"]["reused_tokens"] == fresh["stats"]["disk_cache_tokens"] >= reply_tokens
    assert fresh["input_tokens"] == s2["prompt_tokens"]


def test_continue_includes_earlier_turns(llm_env):
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "6", "first question"))
    assert_ok(llm_env.run("-c", "second question", "-o", "max_tokens", "6"))
    first, second = llm_env.turns()
    assert second["thread_id"] == first["thread_id"]
    # the second prompt holds the first turn, its reply and the new message
    assert second["input_tokens"] > first["input_tokens"] + first["output_tokens"]
    # same process: the engine reused the first turn from its KV cache
    assert second["stats"]["reused_tokens"] == first["input_tokens"] + first["output_tokens"]


def test_python_conversation_reuses_engine(llm_env):
    from llm_mlx_streaming.engine.manager import get_manager

    model = llm.get_model("sm")
    conversation = model.conversation()
    r1 = conversation.prompt("one", max_tokens=8)
    r1.text()
    r2 = conversation.prompt("two", max_tokens=8)
    r2.text()
    j1, j2 = r1.json(), r2.json()
    assert j2["reused_tokens"] == j1["prompt_tokens"] + j1["generated_tokens"]
    assert r2.usage().input == j2["prompt_tokens"]
    assert get_manager().bad_slots() == 0


def _forcing_sampler(schedule):
    """A greedy sampler that emits `schedule[i]` at step i when it is not None."""
    import mlx.core as mx

    step = {"n": 0}

    def sample(logprobs):
        n = step["n"]
        step["n"] += 1
        if n < len(schedule) and schedule[n] is not None:
            return mx.array([schedule[n]])
        return mx.argmax(logprobs, axis=-1)

    return sample


def test_think_blocks_stream_as_reasoning(llm_env, monkeypatch):
    from llm_mlx_streaming.engine.manager import get_manager
    from llm_mlx_streaming.engine.request import Request

    get_manager().load(llm_env.checkpoint, expert_slots=4)
    tok = get_manager().tokenizer
    schedule = [tok.think_start_id, None, None, None, tok.think_end_id]
    monkeypatch.setattr(Request, "make_sampler", lambda self: _forcing_sampler(schedule))

    result = assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "10", "think first"))
    assert "<think>" not in result.output and "</think>" not in result.output
    reasoning = result.stderr.strip()
    assert reasoning and reasoning not in result.stdout
    hidden = assert_ok(llm_env.run("-m", "mlx-stream", "-R", "-o", "max_tokens", "10", "think first"))
    assert hidden.stderr == "" and hidden.stdout == result.stdout

    # the next turn renders the reasoning back inside its tags: full cache reuse
    assert_ok(llm_env.run("-c", "go on", "-o", "max_tokens", "4"))
    prev, last = llm_env.turns()[-2:]
    assert last["stats"]["reused_tokens"] == prev["input_tokens"] + prev["output_tokens"]


class _Interrupt:
    """A sampler that raises KeyboardInterrupt on its `at`-th call (as Ctrl-C would)."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, logprobs):
        import mlx.core as mx

        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return mx.argmax(logprobs, axis=-1)


def test_keyboard_interrupt_leaves_engine_usable(llm_env, monkeypatch):
    from llm_mlx_streaming.engine.manager import get_manager
    from llm_mlx_streaming.engine.request import Request

    baseline = assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "8", "interrupt me")).stdout
    with monkeypatch.context() as m:
        m.setattr(Request, "make_sampler", lambda self: _Interrupt(4))
        result = llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "8", "interrupt me")
    assert result.exit_code == 1 and "Aborted" in result.output
    assert len(llm_env.turns()) == 1  # nothing logged for the interrupted prompt
    assert get_manager().bad_slots() == 0
    again = assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "8", "interrupt me"))
    assert again.stdout == baseline
    assert get_manager().bad_slots() == 0


def test_an_abandoned_stream_does_not_wedge_the_engine(llm_env):
    """A caller that stops iterating (Ctrl-C caught, break) holds nothing: the next
    prompt runs, and the abandoned stream can still be read to its end."""
    from llm_mlx_streaming.engine.manager import get_manager

    model = llm.get_model("mlx-stream")
    full = model.prompt("abandon", max_tokens=8).text()
    stream = iter(model.prompt("abandon", max_tokens=8))
    first = next(stream)  # the engine has started this generation
    assert model.prompt("abandon", max_tokens=8).text() == full
    assert get_manager().bad_slots() == 0
    assert first + "".join(stream) == full


def test_bundled_default_builds_on_first_use(tmp_path, monkeypatch):
    from plugin_support import LlmEnv

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "fresh"))
    env = LlmEnv(tmp_path / "fresh", tmp_path)
    result = assert_ok(env.run("-m", "mlx-stream", "-o", "max_tokens", "4", "hi"))
    assert "unpacking the bundled demo model" in result.stderr
    [turn] = env.turns()
    assert turn["stats"]["expert_slots"] == 8
    assert "tiny-moe" in turn["resolved_model"]
    again = assert_ok(env.run("-m", "mlx-stream/tiny-moe", "-o", "max_tokens", "4", "hi"))
    assert "unpacking" not in again.stderr and again.stdout == result.stdout


def test_pool_options_change_figures_not_text(llm_env):
    base = assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "10", "pool sizes")).stdout
    small = assert_ok(
        llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "10", "-o", "expert_slots", "2",
                    "-o", "policy", "lru", "pool sizes")
    ).stdout
    full = assert_ok(
        llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "10", "-o", "expert_slots", "8", "pool sizes")
    ).stdout
    assert base == small == full
    s4, s2, s8 = (t["stats"] for t in llm_env.turns())
    assert (s4["expert_slots"], s2["expert_slots"], s8["expert_slots"]) == (4, 2, 8)
    assert s2["policy"] == "lru" and s2["unplaced"] == 0
    assert s2["misses"] > 0 and s8["misses"] == 0 and s8["mb_read"] == 0  # 8 slots: all resident


def test_seeded_sampling_is_repeatable(llm_env):
    args = ["-m", "mlx-stream", "-o", "max_tokens", "12", "-o", "temperature", "1.5",
            "-o", "top_k", "20", "-o", "seed", "7", "sample"]
    first = assert_ok(llm_env.run(*args)).stdout
    assert assert_ok(llm_env.run(*args)).stdout == first
    greedy = assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "12", "sample")).stdout
    assert first != greedy
