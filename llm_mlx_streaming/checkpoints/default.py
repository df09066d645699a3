"""The bundled demo model: a small trained MoE that ships inside the package.

``llm -m mlx-stream "..."`` must work right after install, with no download, and
write something a person can read. So the package carries a 4-bit qwen3_moe
(4 layers, 16 experts, top-2) trained on Python's documentation by
``tools/train_demo.py`` (docs/demo-model.md). First use copies it under
``llm.user_dir()``, where it is ours to pack, check and copy again if damaged
(the installed package may be read-only). It is served with 8 slots for 16
experts, so experts really stream.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import llm
from .config import check_checkpoint
from ..errors import CheckpointError

# Bump the directory name when the shipped files change, so an old copy is not reused.
BUNDLED_DIR = "tiny-moe-pydocs-v2"
SHIPPED = Path(__file__).resolve().parent / "demo"
SHIPPED_HASHES = Path(__file__).resolve().parent / "demo.sha256.json"  # for `llm mlxs verify` (tools/train_demo.py)
MARKER = "bundled.json"  # {file name: size} of the copy, written last


def bundled_path() -> Path:
    """Where the demo checkpoint is served from (it may not be copied there yet)."""
    return llm.user_dir() / "mlx-streaming" / BUNDLED_DIR


def shipped_files() -> dict[str, int]:
    """{file name: size} of the checkpoint inside the package."""
    return {p.name: p.stat().st_size for p in sorted(SHIPPED.iterdir()) if p.is_file()}


def is_built() -> bool:
    """True when the copy under user_dir is complete (its marker matches the package)."""
    try:
        return json.loads((bundled_path() / MARKER).read_text()) == shipped_files()
    except (OSError, ValueError):
        return False


def default_checkpoint() -> Path:
    """Path of the demo checkpoint, copying it out of the package on first use, and
    again if its files are damaged (the copy is ours to replace)."""
    path = bundled_path()
    if not is_built():
        print(f"mlx-stream: unpacking the bundled demo model into {path} (first use only)...",
              file=sys.stderr, flush=True)
        _copy(path)
    problem = damage(path)
    if problem:
        print(f"mlx-stream: the bundled demo model is damaged ({problem}); copying it again...",
              file=sys.stderr, flush=True)
        shutil.rmtree(path)
        _copy(path)
    return path


def _copy(path: Path) -> None:
    """Copy the shipped files in, each through a temporary name and an atomic rename, so
    concurrent first uses and interrupted copies never leave a half-written file."""
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).unlink(missing_ok=True)
    files = shipped_files()
    for name in files:
        tmp = path / f".{name}.{os.getpid()}.tmp"
        shutil.copyfile(SHIPPED / name, tmp)
        os.replace(tmp, path / name)
    tmp = path / f".{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(files, indent=2))
    os.replace(tmp, path / MARKER)


def damage(path: Path) -> str | None:
    """What is wrong with the copied demo checkpoint, from its file sizes, headers and
    small files alone (None: nothing found)."""
    for name, size in shipped_files().items():
        try:
            found = (path / name).stat().st_size
        except OSError:
            return f"{path / name} is missing"
        if found != size:
            return f"{path / name} has {found} bytes, not {size}"
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
