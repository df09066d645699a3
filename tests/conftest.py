"""Shared fixtures: tiny random checkpoints, built once per test session."""

import json

import pytest


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """build(arch, **kwargs) -> path of a tiny checkpoint, cached for the session."""
    from fixtures.factory import build_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    built = {}

    def _build(arch="qwen3_moe", **kwargs):
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in built:
            built[key] = build_checkpoint(root / f"ckpt{len(built)}-{arch}", arch, **kwargs)
        return built[key]

    return _build


# -- llm plugin tests (tests/test_plugin_*.py) --------------------------------


@pytest.fixture(scope="session")
def plugin_checkpoint(build):
    """The checkpoint the plugin tests serve: the default tiny qwen3_moe (8 experts)."""
    return build("qwen3_moe")


@pytest.fixture
def llm_env(tmp_path, monkeypatch, plugin_checkpoint):
    """An isolated llm user dir (LLM_USER_PATH) serving plugin_checkpoint as 'small'
    (the default model, 4 expert slots), driven through llm's real CLI."""
    from plugin_support import LlmEnv

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    env = LlmEnv(tmp_path / "llm", plugin_checkpoint)
    env.write_settings(
        default_model="small",
        models={"small": {"path": str(plugin_checkpoint), "aliases": ["sm"], "expert_slots": 4}},
    )
    return env
