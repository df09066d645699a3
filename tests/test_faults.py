"""Faults injected into the expert reads: every one is a clean failure, never a lost
slot, a half-filled slot or a changed output afterwards."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from exactness import greedy_tokens, prompt_tokens, vocab_size
from llm_mlx_streaming.engine.loading import load_streaming
from llm_mlx_streaming.experts import policies, pool as pool_mod

EXPERTS, TOP_K, SLOTS = 16, 4, 6
# The steps of ExpertPool.ensure: its own lines and its policy's. (The reader's lines are
# not interrupted here: its threads are joined before it returns, and an interrupt
# between two of its lines is the reader's own test, tests/test_engine.py.)
TRACED = {Path(m.__file__).resolve() for m in (pool_mod, policies)}


@pytest.fixture
def qwen(build):
    return build("qwen3_moe", quant="4bit", num_experts=EXPERTS, top_k=TOP_K)


def assert_pool_sound(pool, device_map: bool = True):
    """Every slot is free or holds exactly one expert whose bytes match the disk.

    `device_map`: also check the map on the device (only from the thread that made it:
    MLX streams belong to their thread; the engine's next prompt uses it otherwise)."""
    occupied = [s for s, e in enumerate(pool.expert_in) if e >= 0]
    for s in occupied:
        assert pool.slot_of[pool.expert_in[s]] == s
    assert sorted(occupied + list(pool._free)) == list(range(pool.slots))  # none lost
    assert int((pool.slot_of >= 0).sum()) == len(occupied)
    if device_map:
        device = np.array(pool.device_map)
        for e in np.nonzero(pool.slot_of >= 0)[0]:
            assert device[e] == pool.slot_of[e]
    assert pool.bad_slots() == 0


def interrupt_at_line(n: int):
    """A tracer that raises KeyboardInterrupt at the n-th line run in TRACED code."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        if Path(frame.f_code.co_filename).resolve() in TRACED:
            return local
        return None

    return tracer, seen


def interrupt_each_line(pool, prepare, step, after=None) -> int:
    """Run `step(prepare())` interrupted at its 1st, 2nd, ... line in TRACED code, until
    it runs to its end; the pool must be sound after each (then `after` runs with the
    same argument). Returns how many runs were interrupted."""
    n = interrupted = 0
    while True:
        n += 1
        arg = prepare()
        tracer, seen = interrupt_at_line(n)
        sys.settrace(tracer)
        try:
            step(arg)
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            sys.settrace(None)
        assert_pool_sound(pool)
        if seen[0] < n:  # the step finished before the n-th line: every line was hit
            return interrupted
        if after is not None:
            after(arg)


def test_an_interrupt_at_any_step_of_ensure_loses_no_slot(qwen):
    loaded = load_streaming(qwen, expert_slots=SLOTS)
    try:
        prompt = prompt_tokens(vocab_size(qwen), n=12)
        expected = greedy_tokens(loaded.model, prompt, 8)
        pool = loaded.pools[0]
        rng = np.random.default_rng(1)

        def prepare():
            # A full pool, so that the next call must evict (the bookkeeping is traced too).
            pool.ensure(np.arange(SLOTS))
            return rng.choice(np.arange(SLOTS, EXPERTS), TOP_K, replace=False)

        def after(needed):
            pool.ensure(needed)
            assert all(pool.slot_of[e] >= 0 for e in needed)
            assert_pool_sound(pool)

        interrupted = interrupt_each_line(pool, prepare, pool.ensure, after)
        assert interrupted > 20
        assert greedy_tokens(loaded.model, prompt, 8) == expected
        assert sum(p.bad_slots() for p in loaded.pools) == 0
        assert sum(p.counters.unplaced for p in loaded.pools) == 0
    finally:
        loaded.store.close()


# -- through llm's CLI: one line, nothing logged, the engine still exact ----------------

PROMPT = "Name three file systems"
TOKENS = 8


def _expected(checkpoint) -> str:
    from plugin_support import mlx_lm_text

    from plugin_support import split_reply

    return split_reply(mlx_lm_text(checkpoint, [{"role": "user", "content": PROMPT}], TOKENS))[0] + "\n"


def _prompt(env, *extra):
    return env.run("-m", "mlx-stream", "-o", "max_tokens", str(TOKENS), *extra, PROMPT)


def _chat_turn(env, *extra):
    """The prompt as a turn of `llm chat`, whose loop (unlike `llm prompt`) catches no
    error itself: whatever reaches it unconverted is a traceback."""
    return env.run("chat", "-m", "mlx-stream", "-o", "max_tokens", str(TOKENS), *extra,
                   input=f"{PROMPT}\nquit\n")


def _engine_sound(env):
    """The engine that served the failed prompt: every slot true to the disk, and the
    next prompt's output exact."""
    from plugin_support import assert_ok

    from llm_mlx_streaming.engine.manager import get_manager

    assert get_manager().bad_slots() == 0
    rows = len(env.turns())
    assert assert_ok(_prompt(env)).stdout == _expected(env.checkpoint)
    assert len(env.turns()) == rows + 1


@pytest.fixture
def fresh_engine(llm_env):
    """llm_env with the process-wide engine unloaded before and after (the tests
    damage files under it)."""
    from llm_mlx_streaming.engine.manager import get_manager

    get_manager().unload()
    yield llm_env
    get_manager().unload()


def _failing_preadv(mp, fail_at: int, fault):
    """os.preadv that calls `fault(n, fd, buffers, offset)` on the fail_at-th call onward
    (fault returns the call's result or raises)."""
    import os as os_mod

    real = os_mod.preadv
    calls = [0]

    def preadv(fd, buffers, offset):
        calls[0] += 1
        if calls[0] >= fail_at:
            return fault(calls[0], fd, buffers, offset, real)
        return real(fd, buffers, offset)

    mp.setattr(os_mod, "preadv", preadv)
    return calls


@pytest.mark.parametrize("fail_at", [3])
def test_eio_on_the_nth_read_is_one_line_and_loses_nothing(fresh_engine, fail_at):
    import errno

    from plugin_support import assert_ok, assert_one_line_error

    env = fresh_engine
    assert_ok(env.run("-m", "mlx-stream", "-o", "max_tokens", "1", "load the model"))
    rows = len(env.turns())

    def eio(n, fd, buffers, offset, real):
        raise OSError(errno.EIO, "Input/output error")

    with pytest.MonkeyPatch.context() as mp:
        calls = _failing_preadv(mp, fail_at, eio)
        assert_one_line_error(_chat_turn(env, "-o", "expert_slots", "3"), "Input/output error")
    assert calls[0] >= fail_at
    assert len(env.turns()) == rows  # the failed response is not logged
    _engine_sound(env)


def test_short_reads_are_completed_and_a_read_of_nothing_is_one_line(fresh_engine):
    from plugin_support import assert_ok, assert_one_line_error

    env = fresh_engine

    def half(n, fd, buffers, offset, real):  # the kernel may return less than asked
        first = memoryview(buffers[0])
        return real(fd, [first[: max(1, len(first) // 2)]], offset)

    with pytest.MonkeyPatch.context() as mp:
        calls = _failing_preadv(mp, 1, half)
        assert assert_ok(_prompt(env)).stdout == _expected(env.checkpoint)
    assert calls[0] > 0

    rows = len(env.turns())
    with pytest.MonkeyPatch.context() as mp:
        _failing_preadv(mp, 1, lambda *a: 0)  # end of file where bytes were promised
        assert_one_line_error(_chat_turn(env, "-o", "expert_slots", "3"), "short read")
    assert len(env.turns()) == rows
    _engine_sound(env)


def _shard(env):
    return env.checkpoint / "model.safetensors"


@pytest.fixture
def own_copy(fresh_engine, tmp_path):
    """fresh_engine serving a private copy of the checkpoint as its default (these tests
    damage the files), and the copy's pristine shard bytes."""
    env = fresh_engine
    copy = tmp_path / "own"
    shutil.copytree(env.checkpoint, copy)
    settings = env.read_settings()
    settings["models"]["small"]["path"] = str(copy)
    env.write_settings(**settings)
    env.reference = env.checkpoint  # the shared checkpoint: what exact output is judged on
    env.checkpoint = copy
    return env, _shard(env).read_bytes()


def _truncate(shard, keep=0.35):
    with open(shard, "r+b") as fh:  # in place: the engine's open file sees it
        fh.truncate(int(shard.stat().st_size * keep))


def test_a_shard_truncated_between_two_prompts(own_copy):
    from plugin_support import assert_ok, assert_one_line_error

    env, pristine = own_copy
    assert assert_ok(_prompt(env)).stdout == _expected(env.reference)
    _truncate(_shard(env))
    assert_one_line_error(_chat_turn(env, "-o", "expert_slots", "3"), "short read", "the file changed")
    assert len(env.turns()) == 1
    _shard(env).write_bytes(pristine)  # the same file, whole again
    _engine_sound(env)


def test_a_shard_replaced_between_two_prompts_keeps_serving_what_was_loaded(own_copy, build):
    from plugin_support import assert_ok

    from llm_mlx_streaming.engine.manager import get_manager

    env, _ = own_copy
    assert assert_ok(_prompt(env)).stdout == _expected(env.reference)
    other = build("qwen3_moe", seed=1)  # same shapes, other weights
    tmp = _shard(env).with_suffix(".new")
    shutil.copy(other / "model.safetensors", tmp)
    os.replace(tmp, _shard(env))  # a new file under the old name
    # The open files still hold the loaded model's bytes: no mix of two models.
    assert assert_ok(_prompt(env, "-o", "expert_slots", "3")).stdout == _expected(env.reference)
    assert get_manager().bad_slots() == 0


STEPS = {  # where in ExpertPool.ensure the interrupt lands: the first line run in...
    "start": "ensure",
    "evicting": "forget",  # the policy forgetting a victim: eviction bookkeeping
    "reading": "_read",
}


@pytest.mark.parametrize("step", sorted(STEPS))
def test_an_interrupt_inside_ensure_during_a_prompt_is_clean(fresh_engine, step):
    from plugin_support import assert_ok

    from llm_mlx_streaming.engine.manager import get_manager
    from llm_mlx_streaming.experts.pool import ExpertPool

    env = fresh_engine
    assert_ok(env.run("-m", "mlx-stream", "-o", "max_tokens", "1", "load the model"))
    rows = len(env.turns())
    real = ExpertPool.ensure
    fired = [False]

    def local(frame, event, arg):
        if event == "line" and not fired[0] and frame.f_code.co_name == STEPS[step]:
            fired[0] = True
            raise KeyboardInterrupt
        return local

    def ensure(pool, needed):  # traced on the engine thread until the interrupt fires
        if fired[0]:
            return real(pool, needed)
        sys.settrace(lambda frame, event, arg: local if Path(frame.f_code.co_filename).resolve() in TRACED else None)
        try:
            return real(pool, needed)
        finally:
            sys.settrace(None)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExpertPool, "ensure", ensure)
        result = _prompt(env, "-o", "expert_slots", "3")
    assert fired[0]
    assert result.exit_code == 1 and "Aborted!" in result.stderr and "Traceback" not in result.output
    assert len(env.turns()) == rows
    for pool in get_manager().loaded.pools:
        assert_pool_sound(pool, device_map=False)  # made on the engine thread
    _engine_sound(env)


# -- failure 1: errors while rendering or generating, in a prompt and in `llm chat` --------


def test_a_checkpoint_truncated_during_a_chat_is_one_line(own_copy, monkeypatch):
    from plugin_support import assert_one_line_error

    from llm_mlx_streaming.plugin.model import MlxStreamModel

    env, pristine = own_copy
    real = MlxStreamModel._execute
    turns = [0]

    def execute(self, prompt, response):
        turns[0] += 1
        if turns[0] == 2:
            _truncate(_shard(env), 0.2)
        yield from real(self, prompt, response)

    monkeypatch.setattr(MlxStreamModel, "_execute", execute)
    result = env.run("chat", "-m", "mlx-stream", "-o", "max_tokens", "4", "-o", "expert_slots", "3",
                     input="first turn\nsecond turn\nquit\n")
    # llm's chat loop catches nothing, so the failed turn ends the chat: in one line
    assert_one_line_error(result, "OSError", "short read")
    assert "Chatting with" in result.stdout
    assert len(env.turns()) == 1  # the first turn, not the failed one
    _shard(env).write_bytes(pristine)
    _engine_sound(env)


def _strict_template(env, tmp_path):
    """A model whose chat template refuses a system message, as some real ones do."""
    copy = tmp_path / "strict"
    shutil.copytree(env.checkpoint, copy)
    config_file = copy / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = (
        "{%- if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{%- endif %}" + config["chat_template"]
    )
    config_file.write_text(json.dumps(config))
    settings = env.read_settings()
    settings["models"]["strict"] = {"path": str(copy), "expert_slots": 4}
    env.write_settings(**settings)


def test_a_chat_template_that_raises_is_one_line(fresh_engine, tmp_path):
    from plugin_support import assert_ok, assert_one_line_error

    env = fresh_engine
    _strict_template(env, tmp_path)
    args = ["-m", "mlx-stream/strict", "-o", "max_tokens", str(TOKENS)]
    assert_one_line_error(env.run(*args, "-s", "Be brief.", PROMPT), "TemplateError", "System role not supported")
    chat = env.run("chat", *args, "-s", "Be brief.", input="hello\nquit\n")
    assert_one_line_error(chat, "System role not supported")
    assert env.turns() == []
    assert assert_ok(env.run(*args, PROMPT)).stdout == _expected(env.checkpoint)  # no system: fine


# -- failure 2: telemetry never fails a response ------------------------------------


def test_a_trace_that_cannot_be_written_warns_once_and_the_reply_is_kept(fresh_engine):
    from plugin_support import assert_ok

    env = fresh_engine
    assert_ok(env.run("mlxs", "config", "trace", "on"))
    blocked = env.user_dir / "mlx-streaming" / "traces"
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("a file where the traces folder should be")
    first = assert_ok(_prompt(env))
    assert first.stdout == _expected(env.checkpoint)
    warnings = [line for line in first.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and "warning" in warnings[0] and "trace" in warnings[0], first.stderr
    second = assert_ok(_prompt(env))
    assert "trace" not in second.stderr  # once
    assert len(env.turns()) == 2
    assert env.turns()[-1]["stats"]["trace_error"]


def test_a_reader_replaced_after_a_shard_was_replaced_still_reads_the_loaded_files(own_copy, build):
    """New reader settings (`threads`) replace the engine's reader: it must keep reading
    the files the model was loaded from, not mix a replaced file's experts with the
    dense weights already in memory."""
    from plugin_support import assert_ok

    from llm_mlx_streaming.engine.manager import get_manager

    env, _ = own_copy
    assert assert_ok(_prompt(env)).stdout == _expected(env.reference)
    tmp = _shard(env).with_suffix(".new")
    shutil.copy(build("qwen3_moe", seed=1) / "model.safetensors", tmp)
    os.replace(tmp, _shard(env))
    assert_ok(env.run("mlxs", "config", "threads", "3"))
    assert assert_ok(_prompt(env, "-o", "expert_slots", "3")).stdout == _expected(env.reference)
    assert get_manager().running.threads == 3 and get_manager().bad_slots() == 0
