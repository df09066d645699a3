"""The models this server serves, and what their checkpoints say about them (for
/v1/models and Ollama's /api/tags, /api/show, /api/ps), read from the files without
loading anything."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..checkpoints.config import read_config
from ..errors import CheckpointError, MlxStreamError
from ..experts.index import CheckpointIndex
from ..options.registry import checkpoint_for, name_of
from ..options.run_config import checked_name
from ..options.settings import load_settings


LATEST = ":latest"  # Ollama's default tag: `name` and `name:latest` are one model


def untagged(name: Optional[str]) -> Optional[str]:
    """A requested model name without Ollama's default tag, which its clients add."""
    return name.removesuffix(LATEST) if name else name


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
        """Ollama's quantization_level: Q4, Q8, MXFP4 (mlx's quantization), else the weights' dtype."""
        quantization = self.config.get("quantization") or {}
        if quantization.get("mode") not in (None, "affine"):
            return str(quantization["mode"]).upper()
        if quantization.get("bits"):
            return f"Q{quantization['bits']}"
        return DTYPES.get(str(self.config.get("torch_dtype") or self.config.get("dtype") or ""), "")

    @property
    def parameter_size(self) -> str:
        """Ollama's parameter_size ("30.5B"): the parameters in the safetensors headers, a
        quantized weight counted as the values it packs."""
        try:
            tensors = CheckpointIndex(self.path).tensors
        except CheckpointError:
            return ""
        bits = (self.config.get("quantization") or {}).get("bits")
        count = 0
        for name, entry in tensors.items():
            stem = name.rsplit(".", 1)[0]
            if name.endswith((".scales", ".biases")) and f"{stem}.weight" in tensors:
                continue
            values = math.prod(entry.shape)
            count += values * 32 // bits if bits and entry.dtype == "U32" else values
        return _counted(count)


DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _counted(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


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
