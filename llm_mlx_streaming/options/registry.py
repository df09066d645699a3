"""The models the plugin serves: the bundled demo plus user-added checkpoints.

Names are resolved here (name, alias or ``mlx-stream/<name>``) so the llm model
class, the CLI and ``config default_model`` all agree, and so a deleted
checkpoint directory becomes a one-line error instead of a traceback deep in
the loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import CheckpointError, SettingsError
from ..values import NAME_RE
from .knobs import BUNDLED_NAME
from .settings import ModelEntry, Settings, load_settings, save_settings
from ..checkpoints import vision
from ..checkpoints.config import read_config
from ..checkpoints.default import SHIPPED, default_checkpoint

MODEL_PREFIX = "mlx-stream"
BUNDLED_EXPERT_SLOTS = 8


def _strip_prefix(name: str) -> str:
    if name.startswith(MODEL_PREFIX + "/"):
        return name[len(MODEL_PREFIX) + 1 :]
    return name


def canonical_name(name: str, settings: Optional[Settings] = None) -> str:
    """Canonical model name for a name or alias; raises SettingsError if unknown."""
    settings = settings or load_settings()
    key = _strip_prefix(name)
    if key == BUNDLED_NAME or key in settings.models:
        return key
    for entry_name, entry in settings.models.items():
        if key in entry.aliases:
            return entry_name
    known = ", ".join([BUNDLED_NAME, *settings.models])
    raise SettingsError(f"Unknown model '{name}'. Known models: {known}")


def model_id_for(name: str, settings: Optional[Settings] = None) -> str:
    """The llm model id (`mlx-stream`: the default model, or `mlx-stream/<name>`) that a
    model id, name or alias stands for; SettingsError if none."""
    return MODEL_PREFIX if name == MODEL_PREFIX else f"{MODEL_PREFIX}/{canonical_name(name, settings)}"


def name_of(model_id: str) -> Optional[str]:
    """The registered name of a model id from `model_id_for` (None: the default model)."""
    return None if model_id == MODEL_PREFIX else _strip_prefix(model_id)


def model_ids(settings: Optional[Settings] = None) -> list[str]:
    """Every model id the plugin registers with llm."""
    settings = settings or load_settings()
    return [MODEL_PREFIX, *(f"{MODEL_PREFIX}/{name}" for name in (BUNDLED_NAME, *settings.models))]


def default_name(settings: Optional[Settings] = None) -> str:
    settings = settings or load_settings()
    return settings.default_model or BUNDLED_NAME


def dir_size(path: Path) -> int:
    """Bytes of a checkpoint directory, not counting its packed store (a copy)."""
    from ..experts.packed import PACKED_DIR

    packed = path / PACKED_DIR
    return sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and packed not in p.parents
    )


def checkpoint_for(name: str, settings: Optional[Settings] = None) -> tuple[Path, Optional[ModelEntry]]:
    """Checkpoint directory for a canonical name (copying the bundled one out of the package if needed)."""
    settings = settings or load_settings()
    if name == BUNDLED_NAME:
        return default_checkpoint(), None
    entry = settings.models.get(name)
    if entry is None:
        raise SettingsError(f"Unknown model '{name}'; see `llm mlxs models`")
    path = Path(entry.path)
    if not path.is_dir():
        raise SettingsError(
            f"Checkpoint directory for '{name}' no longer exists: {path} "
            f"(run `llm mlxs remove {name}` or add it again)"
        )
    return path, entry


def takes_images(name: Optional[str], settings: Optional[Settings] = None) -> bool:
    """Whether the model `name` (None: the default) takes images, read off its checkpoint's
    config.json alone (no copy, no load); False when that cannot be read, where a prompt
    says why."""
    try:
        settings = settings or load_settings()
        name = canonical_name(name or default_name(settings), settings)
        folder = SHIPPED if name == BUNDLED_NAME else checkpoint_for(name, settings)[0]
        return vision.takes_images(read_config(folder))
    except (SettingsError, CheckpointError, OSError, ValueError):
        return False


def effective_slots(name: str, entry: Optional[ModelEntry], settings: Settings) -> Optional[int]:
    """Pool size when no -o expert_slots is given: the model's own setting, then
    the global one, then 8 for the bundled demo; None: the pools are sized by the
    memory_budget plan."""
    if entry is not None and entry.expert_slots:
        return entry.expert_slots
    if settings.expert_slots:
        return settings.expert_slots
    if name == BUNDLED_NAME:
        return BUNDLED_EXPERT_SLOTS
    return None


def slots_source(name: str, entry: Optional[ModelEntry], settings: Settings) -> Optional[str]:
    """Which setting `effective_slots` took its count from: model, setting or bundled."""
    if entry is not None and entry.expert_slots:
        return "model"
    if settings.expert_slots:
        return "setting"
    if name == BUNDLED_NAME:
        return "bundled"
    return None


def taken_names(settings: Settings) -> set[str]:
    names = {BUNDLED_NAME, *settings.models}
    for entry in settings.models.values():
        names.update(entry.aliases)
    return names


def add_model(
    name: str, path: Path, source: str, aliases: list[str], expert_slots: Optional[int] = None
) -> ModelEntry:
    """Register a validated checkpoint directory under ``name``."""
    settings = load_settings()
    for candidate in [name, *aliases]:
        if not NAME_RE.match(candidate):
            raise SettingsError(
                f"Invalid name '{candidate}': use letters, digits, '.', '_' or '-'"
            )
    taken = taken_names(settings)
    if name in taken:
        raise SettingsError(
            f"A model called '{name}' already exists; remove it first or pass --name"
        )
    for alias in aliases:
        if alias in taken:
            raise SettingsError(f"Alias '{alias}' is already in use")
    if len(set(aliases)) != len(aliases):
        raise SettingsError("Duplicate alias")
    entry = ModelEntry(path=str(path), source=source, aliases=aliases, expert_slots=expert_slots)
    settings.models[name] = entry
    save_settings(settings)
    return entry


def remove_model(name: str) -> tuple[str, bool]:
    """Unregister a model (files stay on disk). Returns (name, was_default)."""
    settings = load_settings()
    canonical = canonical_name(name, settings)
    if canonical == BUNDLED_NAME:
        raise SettingsError(f"'{BUNDLED_NAME}' is bundled with the plugin and cannot be removed")
    del settings.models[canonical]
    was_default = settings.default_model == canonical
    if was_default:
        settings.default_model = None
    save_settings(settings)
    return canonical, was_default


def set_default(name: str) -> str:
    settings = load_settings()
    canonical = canonical_name(name, settings)
    if canonical != BUNDLED_NAME:
        checkpoint_for(canonical, settings)  # its directory must still be there
    settings.default_model = None if canonical == BUNDLED_NAME else canonical
    save_settings(settings)
    return canonical
