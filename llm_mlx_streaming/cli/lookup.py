"""A model name, alias or directory -> its checkpoint, for the commands that take one."""

from __future__ import annotations

from pathlib import Path

from ..options import registry
from ..checkpoints.config import read_config
from ..errors import SettingsError
from ..options.knobs import BUNDLED_NAME
from ..options.settings import Settings


def find_checkpoint(name: str | None, settings: Settings) -> tuple[str, Path, object]:
    """(label, checkpoint dir, registry entry or None) for a model name, alias,
    `mlx-stream` (the default model; also when NAME is omitted) or a directory."""
    if name in (None, registry.MODEL_PREFIX):
        canonical = registry.default_name(settings)
    else:
        try:
            canonical = registry.canonical_name(name, settings)
        except SettingsError:
            local = Path(name).expanduser()
            if local.is_dir():
                read_config(local)
                return str(local.resolve()), local.resolve(), None
            known = ", ".join([BUNDLED_NAME, *settings.models])
            raise SettingsError(
                f"Unknown model '{name}' (nor a checkpoint directory). Known models: {known}"
            ) from None
    path, entry = registry.checkpoint_for(canonical, settings)
    return f"{registry.MODEL_PREFIX}/{canonical}", path, entry


def has_packed(path: Path) -> bool:
    from ..experts.packed import INDEX_NAME, packed_dir

    return (packed_dir(path) / INDEX_NAME).is_file()
