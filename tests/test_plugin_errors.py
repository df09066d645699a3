"""Every bad input is one error line, never a traceback, and nothing is logged."""

from __future__ import annotations

import shutil

import pytest

from plugin_support import assert_llm_option_error, assert_ok, assert_one_line_error


def _no_rows(env):
    assert env.turns() == []


def test_unknown_model(llm_env):
    assert_one_line_error(llm_env.run("-m", "mlx-stream/ghost", "hi"), "mlx-stream/ghost")
    _no_rows(llm_env)


@pytest.mark.parametrize(
    "option, value",
    [("temperature", "-1"), ("max_tokens", "-2"), ("expert_slots", "zero"), ("policy", "fifo"), ("top_p", "2"), ("colour", "red"),
     ("memory_budget", "lots")],
)
def test_bad_option_values(llm_env, option, value):
    assert_llm_option_error(llm_env.run("-m", "mlx-stream", "-o", option, value, "hi"), option)
    _no_rows(llm_env)


def test_deleted_checkpoint_dir(llm_env, tmp_path):
    copy = tmp_path / "gone"
    shutil.copytree(llm_env.checkpoint, copy)
    assert_ok(llm_env.run("mlxs", "add", str(copy)))
    shutil.rmtree(copy)
    assert_one_line_error(llm_env.run("-m", "mlx-stream/gone", "hi"), "no longer exists", str(copy))
    assert_one_line_error(llm_env.run("mlxs", "default", "gone"), "no longer exists")
    llm_env.write_settings(**{**llm_env.read_settings(), "default_model": "gone"})  # gone after it became the default
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "hi"), "no longer exists")
    # chat (which does not catch model errors itself) is one line too
    assert_one_line_error(llm_env.run("chat", "-m", "mlx-stream", input="hi\nquit\n"), "no longer exists")
    _no_rows(llm_env)
    assert "missing" in assert_ok(llm_env.run("mlxs", "models")).stdout


def test_settings_file_not_json(llm_env):
    llm_env.settings_file.write_text("{not json")
    name = str(llm_env.settings_file)
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "hi"), name, "not valid JSON")
    assert_one_line_error(llm_env.run("mlxs", "config"), name)
    assert_one_line_error(llm_env.run("mlxs", "models"), name)
    # other llm commands keep working
    assert "mlx-stream" in assert_ok(llm_env.run("models", "list")).stdout
    _no_rows(llm_env)


def test_settings_file_wrong_type(llm_env):
    llm_env.write_settings(max_tokens="lots")
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "hi"), str(llm_env.settings_file), "max_tokens")
    _no_rows(llm_env)


def test_prompt_longer_than_context(llm_env):
    long_prompt = "tea " * 5000  # the tiny checkpoints have a 4096-token context
    assert_one_line_error(llm_env.run("-m", "mlx-stream", long_prompt), "context of 4096")
    _no_rows(llm_env)
    assert_ok(llm_env.run("-m", "mlx-stream", "-o", "max_tokens", "2", "short"))  # still usable


def test_attachments_and_tools_are_refused(llm_env, tmp_path):
    image = tmp_path / "x.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 32)
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "-a", str(image), "describe"),
                          "does not support attachments")
    assert_one_line_error(llm_env.run("-m", "mlx-stream", "--functions", "def f(): return 1", "hi"),
                          "chat template has no tool support")  # the small model's template has none
    _no_rows(llm_env)
