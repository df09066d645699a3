"""The parameters a running server applies to every request, changeable while it runs.

They are the plugin's own options (read off `Options`, so a new option is a runtime
parameter too), validated by the same pydantic model, set for every model or for one
(`llm mlxs config KEY VALUE --model NAME`). A request's own fields win over them, a
model's own win over every model's, and they win over the settings file. Changing a
pool parameter rebuilds the pools of the loaded models it applies to (each within its
share of the memory budget); the rest apply from the next request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from ..options.settings import Options
from ..options.settings import first_error
from .fields import engine_option_names

POOL_KEYS = ("expert_slots", "policy", "memory_budget")


class ConfigError(ValueError):
    """An invalid change; the message is one line."""


class RuntimeConfig:
    """The options set on this server: for every model (`values`), and for one model over
    those (`models`, by its checkpoint's path, which every id of the model names)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}  # options set on this server, for every model
        self.models: dict[Path, dict[str, Any]] = {}  # checkpoint path -> options set for its model alone

    def validate(self, changes: Any, model: Optional[Path] = None) -> dict[str, Any]:
        """The values (`model`'s own, or every model's) after `changes` (null unsets a
        key); ConfigError, changing nothing, when a key is unknown or a value invalid."""
        if not isinstance(changes, dict) or not changes:
            raise ConfigError("send a JSON object of option: value (null unsets one)")
        names = engine_option_names()
        for key in changes:
            if key not in names:
                raise ConfigError(f"unknown option {key!r}; options: {', '.join(names)}")
        own = self.models.get(model, {}) if model else self.values
        merged = {k: v for k, v in {**own, **changes}.items() if v is not None}
        try:
            options = Options.model_validate({**self.values, **merged})
        except ValidationError as e:
            raise ConfigError(first_error(e)) from None
        return {k: getattr(options, k) for k in merged}

    def set(self, values: dict[str, Any], model: Optional[Path] = None) -> None:
        """Make `values` (from `validate`) the options of `model` (None: of every model)."""
        if model is None:
            self.values = values
        elif values:
            self.models[model] = values
        else:
            self.models.pop(model, None)

    def set_for(self, model: Optional[Path]) -> dict[str, Any]:
        """The options set here that apply to `model`: its own over every model's."""
        return {**self.values, **self.models.get(model, {})} if model else dict(self.values)

    def options(self, model: Optional[Path] = None) -> Options:
        return Options.model_validate(self.set_for(model))

    def shown(self, settings, model: Optional[Path] = None) -> dict[str, Any]:
        """Every option's value on this server (for `model`): set here, else the setting
        of the same name, else None (the plugin's default)."""
        values = self.set_for(model)
        return {name: values[name] if name in values else getattr(settings, name, None)
                for name in engine_option_names()}

    def for_request(self, fields: dict[str, Any], model: Optional[Path] = None) -> dict[str, Any]:
        return {**self.set_for(model), **fields}


def touches_pools(changes: dict) -> bool:
    return any(key in POOL_KEYS for key in changes)
