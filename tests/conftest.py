"""Shared fixtures: tiny random checkpoints, built once per test session."""

import json

import pytest


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """build(arch, **kwargs) -> path of a tiny checkpoint, cached for the session."""
    from llm_mlx_streaming.checkpoints.factory import build_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    built = {}

    def _build(arch="qwen3_moe", **kwargs):
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in built:
            built[key] = build_checkpoint(root / f"ckpt{len(built)}-{arch}", arch, **kwargs)
        return built[key]

    return _build
