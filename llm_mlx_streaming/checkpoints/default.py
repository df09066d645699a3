"""The bundled demo model: a tiny random MoE built on first use.

No weights ship with the plugin and nothing is downloaded, yet
``llm -m mlx-stream "hi"`` must work right after install. So the first use
builds a small, deterministic qwen3_moe checkpoint with the factory under
``llm.user_dir()``; its pool (8 slots for 16 experts) is smaller than the
expert count, so experts really stream. Its output is gibberish: it shows the
machinery, not a language model.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import llm

# Bump the directory name when the spec changes, so old builds are not reused.
BUNDLED_DIR = "tiny-moe-v1"
BUNDLED_SPEC = dict(
    arch="qwen3_moe",
    hidden_size=128,
    num_layers=4,
    num_experts=16,
    top_k=4,
    moe_intermediate_size=64,
    quant=None,
    seed=0,
)


def bundled_path() -> Path:
    """Where the demo checkpoint lives (it may not be built yet)."""
    return llm.user_dir() / "mlx-streaming" / BUNDLED_DIR


def is_built() -> bool:
    path = bundled_path()
    return (path / "factory.json").is_file() and (path / "config.json").is_file()


def default_checkpoint() -> Path:
    """Path of the demo checkpoint, building it (once, deterministically) if needed,
    and building it again if its files are damaged (it is ours to rebuild)."""
    from .factory import build_checkpoint

    path = bundled_path()
    if not is_built():
        print(
            f"mlx-stream: building the bundled demo model in {path} (first use only)...",
            file=sys.stderr,
            flush=True,
        )
    spec = dict(BUNDLED_SPEC)
    arch = spec.pop("arch")
    build_checkpoint(path, arch, **spec)
    problem = damage(path)
    if problem:
        print(f"mlx-stream: the bundled demo model is damaged ({problem}); building it again...",
              file=sys.stderr, flush=True)
        shutil.rmtree(path)
        build_checkpoint(path, arch, **spec)
    return path


def damage(path: Path) -> str | None:
    """What is wrong with a built demo checkpoint, from its headers and small files
    alone (None: nothing found)."""
    from ..errors import CheckpointError
    from .config import check_checkpoint

    try:
        check_checkpoint(path)
    except CheckpointError as e:
        return str(e)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        try:
            json.loads((path / name).read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            return f"{path / name} is unreadable"
    return None
