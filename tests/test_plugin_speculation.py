"""Speculative decoding through llm's CLI: -o k / -o draft, settings, figures, bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from plugin_support import assert_llm_option_error, assert_ok, assert_one_line_error

PROMPT = "Repeat after me: the quick brown fox jumps over the lazy dog, the quick brown fox"
FIGURES = ("k", "draft", "draft_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_pass")


def _say(env, *options):
    return assert_ok(env.run("-m", "mlx-stream", "-o", "max_tokens", "16", *options, PROMPT)).stdout


def test_k_3_prints_what_k_0_prints(llm_env, tmp_path):
    plain = _say(llm_env, "-o", "k", "0")
    assert llm_env.turns()[-1]["stats"]["k"] == 0
    for options in (("-o", "k", "3"), ("-o", "k", "auto"), ("-o", "k", "2", "-o", "draft", "ngram")):
        assert _say(llm_env, *options) == plain, options
        stats = llm_env.turns()[-1]["stats"]
        assert all(key in stats for key in FIGURES)
        assert stats["draft"] == "ngram" and stats["verify_passes"] > 0
    # A draft model: any added model with the same vocabulary (here the target's twin,
    # which agrees with it on every token).
    twin = tmp_path / "twin"
    shutil.copytree(llm_env.checkpoint, twin)
    assert_ok(llm_env.run("mlxs", "add", str(twin), "--name", "twin"))
    assert _say(llm_env, "-o", "k", "3", "-o", "draft", "twin") == plain
    stats = llm_env.turns()[-1]["stats"]
    assert stats["draft"] == "twin" and stats["acceptance_rate"] == 1.0 and stats["tokens_per_pass"] > 2
    shown = assert_ok(llm_env.run("mlxs", "stats", "-n", "1")).stdout
    assert "k 3 (twin):" in shown and "(100.0%)" in shown


def test_stop_sequences_end_a_speculative_reply_where_they_end_a_plain_one(llm_env):
    plain = _say(llm_env, "-o", "k", "0")
    stop = plain.strip()[len(plain.strip()) // 2 :][:3]
    cut = _say(llm_env, "-o", "k", "0", "-o", "stop", stop)
    assert len(cut) < len(plain)
    assert _say(llm_env, "-o", "k", "3", "-o", "stop", stop) == cut
    assert llm_env.turns()[-1]["stats"]["finish_reason"] == "stop"


def test_chat_speculates_and_reuses_its_cache(llm_env):
    # the in-process cache is what is measured: the first chat's cache saved on disk
    # (the conversation cache) would give the second chat's second turn even more
    llm_env.write_settings(**{**llm_env.read_settings(), "conversation_cache": False})
    turns = "hello there, hello there\nsay it again\nquit\n"
    plain = assert_ok(llm_env.run("chat", "-m", "mlx-stream", "-o", "max_tokens", "10", "-o", "k", "0", input=turns)).stdout
    spec = assert_ok(llm_env.run("chat", "-m", "mlx-stream", "-o", "max_tokens", "10", "-o", "k", "3", input=turns)).stdout
    assert spec == plain
    first, second = llm_env.turns()[-2:]
    assert second["stats"]["k"] == 3
    # at least everything but the last reply token, which the next turn's prefill feeds
    # (the conversation cache on disk may hold the k = 0 chat's, which has it)
    assert second["stats"]["reused_tokens"] >= first["stats"]["prompt_tokens"] + first["stats"]["generated_tokens"] - 1


def test_settings_k_and_draft(llm_env):
    assert_ok(llm_env.run("mlxs", "config", "k", "3"))
    assert_ok(llm_env.run("mlxs", "config", "draft", "ngram"))
    assert llm_env.read_settings()["k"] == 3
    out = assert_ok(llm_env.run("mlxs", "config")).stdout
    assert any(line.split()[:3] == ["*", "k", "3"] for line in out.splitlines())  # marked set
    _say(llm_env)
    assert llm_env.turns()[-1]["stats"]["k"] == 3
    assert_ok(llm_env.run("mlxs", "config", "k", "auto"))
    assert llm_env.read_settings()["k"] == "auto"
    assert_one_line_error(llm_env.run("mlxs", "config", "k", "two"), "k must be")
    assert_one_line_error(llm_env.run("mlxs", "config", "draft", "no good"), "draft")
    options = assert_ok(llm_env.run("models", "--options", "-m", "mlx-stream")).stdout
    assert "k:" in options and "draft:" in options and "Speculative decoding" in options


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "100"])
def test_bad_k_is_refused_before_anything_runs(llm_env, value):
    assert_llm_option_error(llm_env.run("-m", "mlx-stream", "-o", "k", value, "hi"), "k")
    assert llm_env.turns() == []


def test_a_drafter_given_is_checked_even_while_k_is_0(llm_env):
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "-o", "draft", "nosuchdrafter", "hi"),
                          "Unknown draft 'nosuchdrafter'")
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "-o", "k", "0", "-o", "draft", "nosuch", "hi"),
                          "Unknown draft 'nosuch'")
    for empty in ("", " "):  # not the default drafter in disguise
        assert_llm_option_error(llm_env.run("-m", "mlx-stream", "-o", "k", "2", "-o", "draft", empty, "hi"),
                                "draft")
    assert llm_env.turns() == []


def test_bad_drafters_are_one_line_errors_and_not_logged(llm_env, tmp_path):
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "-o", "k", "2", "-o", "draft", "nosuch", "hi"),
                          "Unknown draft 'nosuch'", "ngram")
    other = tmp_path / "other-vocab"
    shutil.copytree(llm_env.checkpoint, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    assert_ok(llm_env.run("mlxs", "add", str(other), "--name", "otherv"))
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "-o", "k", "2", "-o", "draft", "otherv", "hi"),
                          "'otherv'", "does not share the vocabulary", llm_env.checkpoint.name)
    assert llm_env.turns() == []
