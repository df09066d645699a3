"""Plugin settings: one typed object, one JSON file under ``llm.user_dir()``.

One file and no environment variables, so that ``llm mlxs config`` can show every
knob, validate it with pydantic and write it back, and a setting cannot silently
differ between two shells. The same file holds the registry of user-added models
(``models``), which ``config`` does not list. Only keys the user set are written, so
"is this the default?" is "is the key absent from the file?". llm's `-o` options
(`Options`: each knob that is an option, None meaning "the setting") are built from the
same declarations.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import llm
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import SettingsError
from .knobs import AUTO_BUDGET_SHARE, SETTING_NAMES, SETTINGS_CONFIG, build_options, build_settings
from ..sizes import parse_size


SETTINGS_FILENAME = "mlx-streaming.json"


class ModelEntry(BaseModel):
    """One user-added model: where its checkpoint lives and what it is called."""

    model_config = ConfigDict(extra="ignore")

    path: str = Field(description="Local mlx-lm checkpoint directory")
    source: Optional[str] = Field(
        None, description="What was passed to `llm mlxs add` (a path or HF repo id)"
    )
    aliases: list[str] = Field(default_factory=list)
    expert_slots: Optional[int] = Field(
        None, ge=1, description="Per-model pool size; overrides the global setting"
    )


class _SettingsFile(BaseModel):
    """Everything the plugin can be told (the knobs are declared in knobs.py)."""

    model_config = SETTINGS_CONFIG


Settings = build_settings("Settings", _SettingsFile, {
    "models": (dict[str, ModelEntry], Field(
        default_factory=dict, description="User-added models (managed by `llm mlxs add/remove`).")),
})

Options = build_options(llm.Options)

# Settings shown and edited by `llm mlxs config` (the registry is managed by
# its own commands).
CONFIG_KEYS = SETTING_NAMES


def physical_memory() -> int | None:
    """Bytes of physical memory (Linux and macOS), or None where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        pass
    try:  # pragma: no cover - macOS without SC_PHYS_PAGES
        import subprocess

        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True)
        return int(out.stdout.strip())
    except (OSError, ValueError):
        return None


def budget_bytes(value: str) -> int:
    """A memory_budget value in bytes ("auto": a share of physical memory)."""
    if value == "auto":
        total = physical_memory()
        if not total:
            raise SettingsError(
                "Cannot tell this machine's memory size: set memory_budget, e.g. "
                "`llm mlxs config memory_budget 12GB`"
            )
        return int(total * AUTO_BUDGET_SHARE)
    return parse_size(value)


def traces_dir() -> Path:
    return llm.user_dir() / "mlx-streaming" / "traces"


def trace_file(name: str) -> Path:
    """Where routing traces of model `name` are appended when `trace` is on."""
    return traces_dir() / f"{name}.jsonl"


def settings_path() -> Path:
    return llm.user_dir() / SETTINGS_FILENAME


def _reason(exc: ValidationError) -> str:
    msg = exc.errors()[0].get("msg", "invalid value")
    return msg.removeprefix("Value error, ")


def first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "value"
    return f"{where}: {_reason(exc)}"


def load_settings() -> Settings:
    """Read the settings file; a missing file means all defaults."""
    path = settings_path()
    if not path.exists():
        return Settings()
    try:
        data = json.loads(path.read_text() or "{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(
            f"Settings file {path} is not valid JSON ({exc}); fix or delete it"
        ) from None
    if not isinstance(data, dict):
        raise SettingsError(f"Settings file {path} must hold a JSON object")
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(
            f"Settings file {path} is invalid: {first_error(exc)}"
        ) from None


def save_settings(settings: Settings) -> Path:
    """Write only the keys that differ from the defaults, atomically.

    A folder or file that cannot be written is one line naming it; the old file
    stays as it was."""
    path = settings_path()
    data = settings.model_dump(mode="json", exclude_defaults=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".mlx-streaming-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        reason = exc.strerror or str(exc)
        raise SettingsError(f"Cannot write the settings file {path}: {reason}") from None
    return path


def explicit_keys() -> set[str]:
    """Keys present in the settings file (i.e. not at their default)."""
    settings = load_settings()
    return set(settings.model_dump(exclude_defaults=True))


def check_setting_name(key: str) -> None:
    """A SettingsError unless `key` is one `llm mlxs config` shows."""
    if key not in CONFIG_KEYS:
        raise SettingsError(f"Unknown setting '{key}'. Settings: {', '.join(CONFIG_KEYS)}")


def set_value(key: str, raw: object, settings: Settings | None = None) -> Settings:
    """Validate `raw` (a command-line string) for `key` and save it."""
    check_setting_name(key)
    settings = settings or load_settings()
    try:
        setattr(settings, key, raw)
    except ValidationError as exc:
        raise SettingsError(f"Invalid value for {key}: {raw!r} ({_reason(exc)})") from None
    save_settings(settings)
    return settings


def unset_value(key: str) -> Settings:
    check_setting_name(key)
    settings = load_settings()
    setattr(settings, key, Settings.model_fields[key].get_default(call_default_factory=True))
    save_settings(settings)
    return settings
