"""What a command names -> its files: a model name, alias or directory -> its checkpoint;
a trace file or a model -> its routing trace."""

from __future__ import annotations

from pathlib import Path

from ..options import registry
from ..checkpoints.config import read_config
from ..errors import SettingsError
from ..experts.traces import bundled_traces
from ..options.knobs import BUNDLED_NAME
from ..options.settings import Settings, load_settings, trace_file


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


def trace_path(trace: str) -> tuple[Path, str]:
    """A trace file, the recorded trace of a model (name, alias or mlx-stream), or a trace
    shipped with the package (experts/recorded/: `llm mlxs traces` lists them)."""
    local = Path(trace).expanduser()
    if local.is_file():
        return local, str(local)
    settings = load_settings()
    try:
        canonical = (
            registry.default_name(settings)
            if trace == registry.MODEL_PREFIX
            else registry.canonical_name(trace, settings)
        )
    except SettingsError:
        canonical = None
    path = trace_file(canonical) if canonical else None
    if path is not None and path.is_file():
        return path, f"{registry.MODEL_PREFIX}/{canonical}"
    bundled = bundled_traces()
    if trace in bundled:
        return bundled[trace], f"{trace}, shipped with the plugin"
    if path is None:
        raise SettingsError(f"No such trace file or model: {trace} (traces shipped with the plugin: "
                            f"{', '.join(bundled)})")
    raise SettingsError(
        f"No trace recorded for {registry.MODEL_PREFIX}/{canonical} yet ({path}): "
        "run `llm mlxs config trace on`, then some prompts"
    )
