"""The models this server serves, and what their checkpoints say about them (for
/v1/models and Ollama's /api/tags, /api/show, /api/ps), read from the files without
loading anything."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..checkpoints.config import read_config
from ..errors import MlxStreamError
from ..options.registry import checkpoint_for, name_of
from ..options.run_config import checked_name
from ..options.settings import load_settings


@dataclass
class Checkpoint:
    path: Path
    config: dict
    template: str  # the chat template ("" when it has none)

    @property
    def family(self) -> str:
        return str(self.config.get("model_type") or "")

    @property
    def context_length(self) -> Optional[int]:
        return self.config.get("max_position_embeddings")

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    @property
    def modified_at(self) -> float:
        return self.path.stat().st_mtime

    @property
    def digest(self) -> str:
        return hashlib.sha256(str(self.path).encode()).hexdigest()

    @property
    def quantization(self) -> str:
        bits = (self.config.get("quantization") or {}).get("bits")
        return f"Q{bits}" if bits else ""


def checkpoint(model_id: str) -> Optional[Checkpoint]:
    """The checkpoint behind `model_id` (from registry.model_id_for), or None when its
    files cannot be read."""
    settings = load_settings()
    try:
        path, _ = checkpoint_for(checked_name(name_of(model_id), settings), settings)
        config = read_config(path)
    except (MlxStreamError, OSError, ValueError):
        return None
    return Checkpoint(path, config, _template(path))


def _template(path: Path) -> str:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return ""
    return template if isinstance(template, str) else ""
