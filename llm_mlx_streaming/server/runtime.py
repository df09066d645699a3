"""The parameters a running server applies to every request, changeable while it runs.

They are the plugin's own options (read off `Options`, so a new option is a runtime
parameter too), validated by the same pydantic model. A request's own fields win over
them, and they win over the settings file. Changing a pool parameter rebuilds the
loaded model's pools; the rest apply from the next request.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..options.settings import Options
from ..options.settings import first_error
from .fields import engine_option_names

POOL_KEYS = ("expert_slots", "policy", "memory_budget")


class ConfigError(ValueError):
    """An invalid change; the message is one line."""


class RuntimeConfig:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}  # options set on this server

    def validate(self, changes: Any) -> dict[str, Any]:
        """The values after `changes` (null unsets a key); ConfigError, changing
        nothing, when a key is unknown or a value invalid."""
        if not isinstance(changes, dict) or not changes:
            raise ConfigError("send a JSON object of option: value (null unsets one)")
        names = engine_option_names()
        for key in changes:
            if key not in names:
                raise ConfigError(f"unknown option {key!r}; options: {', '.join(names)}")
        merged = {k: v for k, v in {**self.values, **changes}.items() if v is not None}
        try:
            options = Options.model_validate(merged)
        except ValidationError as e:
            raise ConfigError(first_error(e)) from None
        return {k: getattr(options, k) for k in merged}

    def options(self) -> Options:
        return Options.model_validate(self.values)

    def shown(self, settings) -> dict[str, Any]:
        """Every option's value on this server: set here, else the setting of the same
        name, else None (the plugin's default)."""
        out = {}
        for name in engine_option_names():
            if name in self.values:
                out[name] = self.values[name]
            else:
                out[name] = getattr(settings, name, None)
        return out

    def for_request(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {**self.values, **fields}


def touches_pools(changes: dict) -> bool:
    return any(key in POOL_KEYS for key in changes)
