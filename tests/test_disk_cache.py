"""The conversation cache on disk (#11): a later process continues a conversation from
the saved KV cache; foreign or damaged files are never loaded, the answer stays right.

A "later process" is simulated by dropping the engine's in-process session cache; the
separate-process case through llm's CLI is in test_plugin_prompt.py."""

from __future__ import annotations

import shutil

import llm
import pytest

from plugin_support import assert_ok, assert_one_line_error


def _fresh_process():
    """Forget the in-process KV cache, as a new `llm` process would not have it."""
    from llm_mlx_streaming.engine.manager import get_manager

    get_manager().prompts.reset()


def _cache_files(llm_env):
    root = llm_env.user_dir / "mlx-streaming" / "kv-cache"
    return sorted(p for p in root.glob("*/*.safetensors") if not p.name.startswith("."))


def _first_turn(llm_env):
    model = llm.get_model("mlx-stream")
    conversation = model.conversation()
    first = conversation.prompt("Tell me about tea", max_tokens=8)
    first.text()
    return model, conversation, first


def _cold_second_turn(llm_env, model, first) -> str:
    """The second turn prefilled from scratch (conversation cache off)."""
    settings = llm_env.read_settings()
    llm_env.write_settings(**{**settings, "conversation_cache": False})
    _fresh_process()
    conversation = model.conversation()
    conversation.responses.append(first)
    cold = conversation.prompt("And then?", max_tokens=8)
    text = cold.text()
    assert cold.response_json["reused_tokens"] == 0
    llm_env.write_settings(**settings)
    return text


def test_a_later_process_continues_from_disk(llm_env):
    model, conversation, first = _first_turn(llm_env)
    [saved] = _cache_files(llm_env)
    stats = first.response_json
    assert saved.name.startswith(f"{stats['prompt_tokens'] + stats['generated_tokens']}-")
    assert stats["disk_cache_saved_bytes"] == saved.stat().st_size > 0
    _fresh_process()
    second = conversation.prompt("And then?", max_tokens=8)
    warm = second.text()
    s2 = second.response_json
    assert s2["reused_tokens"] == s2["disk_cache_tokens"] == stats["prompt_tokens"] + stats["generated_tokens"]
    # the second response wrote a segment with only what it added, beside the first
    [kept, latest] = sorted(_cache_files(llm_env), key=lambda p: int(p.name.split("-")[0]))
    assert kept == saved
    assert latest.name.startswith(f"{s2['prompt_tokens'] + s2['generated_tokens']}-")
    assert s2["disk_cache_saved_bytes"] == latest.stat().st_size < saved.stat().st_size
    assert warm == _cold_second_turn(llm_env, model, first)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_cache_file_is_removed_with_a_notice(llm_env, capfd, damage):
    model, conversation, first = _first_turn(llm_env)
    [saved] = _cache_files(llm_env)
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00" * 64)
    _fresh_process()
    capfd.readouterr()
    second = conversation.prompt("And then?", max_tokens=8)
    text = second.text()
    assert "conversation cache" in capfd.readouterr().err
    assert second.response_json["disk_cache_tokens"] == 0
    assert not saved.exists()
    assert text == _cold_second_turn(llm_env, model, first)


def test_a_cache_from_another_checkpoint_is_never_loaded(llm_env, build, capfd):
    other = build("qwen3_moe", seed=7)
    llm_env.write_settings(default_model="other", models={"other": {"path": str(other), "expert_slots": 4}})
    model, conversation, first = _first_turn(llm_env)
    [foreign] = _cache_files(llm_env)
    # the same conversation on the test checkpoint, whose file then holds the other's cache
    llm_env.write_settings(default_model="small", models={"small": {"path": str(llm_env.checkpoint), "expert_slots": 4}})
    model, conversation, first = _first_turn(llm_env)
    [own] = [p for p in _cache_files(llm_env) if p != foreign]
    shutil.copyfile(foreign, own)
    _fresh_process()
    capfd.readouterr()
    second = conversation.prompt("And then?", max_tokens=8)
    text = second.text()
    assert "another checkpoint" in capfd.readouterr().err
    assert second.response_json["disk_cache_tokens"] == 0
    assert text == _cold_second_turn(llm_env, model, first)


def test_the_cache_is_bounded_by_size_lru(llm_env):
    _first_turn(llm_env)
    [one] = _cache_files(llm_env)
    size = one.stat().st_size
    llm_env.write_settings(**{**llm_env.read_settings(), "conversation_cache_size": f"{int(size * 1.5)}B"})
    llm.get_model("mlx-stream").prompt("Name a boat", max_tokens=8).text()
    files = _cache_files(llm_env)
    assert len(files) == 1 and files[0] != one  # the older one was evicted


def test_off_writes_nothing(llm_env):
    llm_env.write_settings(**{**llm_env.read_settings(), "conversation_cache": "off"})
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "4", "hi"))
    assert _cache_files(llm_env) == []
    assert "disk_cache_saved_bytes" not in llm_env.turns()[-1]["stats"]


@pytest.mark.parametrize("key, value", [("conversation_cache", "maybe"), ("conversation_cache_size", "lots")])
def test_bad_settings_are_one_line(llm_env, key, value):
    assert_one_line_error(llm_env.run("mlxs", "config", key, value), key)


def test_a_saved_cache_longer_than_the_shared_prefix_is_cut_back(llm_env):
    """A template that re-renders an earlier reply differently (say, dropping its
    reasoning) shares only the part before it: that part still comes from disk."""
    from llm_mlx_streaming.engine.manager import get_manager

    model, conversation, first = _first_turn(llm_env)
    s1 = first.response_json
    _fresh_process()
    other = model.prompt("Tell me about tea, and coffee", max_tokens=4)  # same start, other turn
    other.text()
    shared = other.response_json
    assert 0 < shared["disk_cache_tokens"] == shared["reused_tokens"] < s1["prompt_tokens"]
    assert shared["prompt_tokens"] == shared["reused_tokens"] + shared["prefilled_tokens"]
    # exact: the cut-back cache gives what a cold prefill gives
    warm = other.text()
    llm_env.write_settings(**{**llm_env.read_settings(), "conversation_cache": False})
    _fresh_process()
    assert model.prompt("Tell me about tea, and coffee", max_tokens=4).text() == warm
    assert get_manager().last_stats["reused_tokens"] == 0


def _tensor_bytes_damaged(path) -> None:
    """Flip 64 bytes in the middle of the largest tensor of a safetensors file: the file
    still reads, its header and every shape and scalar are intact, a K/V block is not."""
    import json

    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    begin, end = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"),
                     key=lambda span: span[1] - span[0])
    assert end - begin >= 128
    middle = 8 + size + (begin + end) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def test_flipped_tensor_bytes_are_detected_and_the_reply_is_the_uncached_one(llm_env, capfd):
    model, conversation, first = _first_turn(llm_env)
    [saved] = _cache_files(llm_env)
    _tensor_bytes_damaged(saved)
    _fresh_process()
    capfd.readouterr()
    second = conversation.prompt("And then?", max_tokens=8)
    text = second.text()
    err = capfd.readouterr().err
    assert f"conversation cache {saved.name}" in err and "checksum" in err
    assert len(err.strip().splitlines()) == 1
    assert second.response_json["disk_cache_tokens"] == second.response_json["reused_tokens"] == 0
    assert not saved.exists()
    assert text == _cold_second_turn(llm_env, model, first)


def _segments(llm_env):
    return sorted(_cache_files(llm_env), key=lambda p: int(p.name.split("-")[0]))


@pytest.mark.parametrize("damaged, reused_from", [(0, None), (1, 0)], ids=["first-segment", "second-segment"])
def test_a_damaged_segment_invalidates_the_rest_of_its_chain(llm_env, capfd, damaged, reused_from):
    """Turn 3 would load two segments; with one of them damaged it falls back on the
    segments before it (or none), removes it and those after it, and replies as an
    uncached turn would."""
    model, conversation, first = _first_turn(llm_env)
    _fresh_process()
    second = conversation.prompt("And then?", max_tokens=8)
    second.text()
    segments = _segments(llm_env)
    assert len(segments) == 2
    _tensor_bytes_damaged(segments[damaged])
    _fresh_process()
    capfd.readouterr()
    third = conversation.prompt("Go on", max_tokens=8)
    text = third.text()
    err = capfd.readouterr().err
    assert err.count("mlx-stream:") == 1 and segments[damaged].name in err and "checksum" in err
    expected = 0 if reused_from is None else int(segments[reused_from].name.split("-")[0])
    assert third.response_json["disk_cache_tokens"] == third.response_json["reused_tokens"] == expected
    assert not any(p.exists() for p in segments[damaged:])
    # the reply an uncached third turn gives
    llm_env.write_settings(**{**llm_env.read_settings(), "conversation_cache": False})
    _fresh_process()
    cold = model.conversation()
    cold.responses.extend([first, second])
    again = cold.prompt("Go on", max_tokens=8)
    assert again.text() == text and again.response_json["reused_tokens"] == 0


def test_eviction_removes_a_conversation_with_all_its_segments(llm_env):
    model, conversation, first = _first_turn(llm_env)
    _fresh_process()
    conversation.prompt("And then?", max_tokens=8).text()
    older = _segments(llm_env)
    assert len(older) == 2
    bound = int(sum(p.stat().st_size for p in older) * 1.2)
    llm_env.write_settings(**{**llm_env.read_settings(), "conversation_cache_size": f"{bound}B"})
    llm.get_model("mlx-stream").prompt("Name a boat", max_tokens=8).text()
    [newer] = _cache_files(llm_env)  # not the older conversation's second segment without its first
    assert newer not in older
