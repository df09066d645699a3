"""`llm mlxs models/add/remove/default`: the registry of models mlx-stream serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import llm

from .. import registry
from ..settings import (
    BUNDLED_NAME,
    Settings,
    SettingsError,
    load_settings,
)

from . import mlxs
from .resolve import _has_packed
from .common import _line, _size, _table


HF_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What mlx-lm itself fetches for a model: weights, configs, tokenizer files.
HF_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]



def _model_rows(settings: Settings) -> list[dict]:
    from ..checkpoints.default import bundled_path, is_built

    default = registry.default_name(settings)
    entries = [(BUNDLED_NAME, bundled_path(), [], "bundled demo (built on first use)", None)]
    entries += [(n, Path(e.path), e.aliases, e.source, e) for n, e in settings.models.items()]
    rows = []
    for name, path, aliases, source, entry in entries:
        row = {
            "name": name,
            "model_id": f"{registry.MODEL_PREFIX}/{name}",
            "aliases": list(aliases),
            "default": name == default,
            "path": str(path),
            "source": source,
            "architecture": None,
            "experts": None,
            "layers": None,
            "size_bytes": None,
            "expert_slots": registry.effective_slots(name, entry, settings),
            "packed": False,
            "problem": None,
        }
        if name == BUNDLED_NAME and not is_built():
            row["problem"] = "not built yet"
        else:
            try:
                row.update(registry.describe(registry.read_config(path)))
                row["size_bytes"] = registry.dir_size(path)
                row["packed"] = _has_packed(path)
            except SettingsError as exc:
                row["problem"] = "missing" if not path.exists() else str(exc)
        rows.append(row)
    return rows


@mlxs.command()
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
def models(json_):
    """List the models mlx-stream can serve."""
    rows = _model_rows(load_settings())
    if json_:
        click.echo(json.dumps(rows, indent=2))
        return
    table = []
    for r in rows:
        shape = f"{r['experts']} x {r['layers']}" if r["experts"] else "-"
        if r["experts"] is None and r["layers"] and not r["problem"]:
            shape = f"dense x {r['layers']}"
        table.append(
            [
                ("* " if r["default"] else "  ") + r["model_id"],
                ", ".join(r["aliases"]) or "-",
                r["architecture"] or "-",
                shape,
                str(r["expert_slots"] or "plan"),
                (_size(r["size_bytes"]) + (" +packed" if r["packed"] else "")) if not r["problem"] else r["problem"],
            ]
        )
    _table(["  model", "aliases", "architecture", "experts x layers", "slots", "size"], table)
    click.echo("* = default, served by -m mlx-stream; slots 'plan' = sized by memory_budget (llm mlxs plan)")


@mlxs.command()
@click.argument("source")
@click.option("-a", "--alias", "aliases", multiple=True, help="Alias for the model (repeatable)")
@click.option("--name", help="Name to register it under (default: the directory or repo name)")
@click.option("--expert-slots", type=click.IntRange(1), help="Expert slots per layer for this model (default: the expert_slots setting)")
def add(source, aliases, name, expert_slots):
    """Add a model: a local mlx-lm checkpoint directory or a Hugging Face repo id.

    \b
    llm mlxs add ~/models/Qwen3-30B-A3B-4bit -a q30
    llm mlxs add mlx-community/Qwen3-30B-A3B-4bit
    """
    local = Path(source).expanduser()
    if local.exists() or source.startswith((".", "/", "~")) or not HF_REPO_RE.match(source):
        if not local.exists():
            raise SettingsError(
                f"No such directory: {source} (nor a Hugging Face repo id like org/name)"
            )
        path = local.resolve()
        stored_source = str(path)
    else:
        path = _download(source)
        stored_source = source
    config_dict = registry.read_config(path)
    name = name or re.sub(r"[^A-Za-z0-9._-]", "-", path.name if stored_source == str(path) else source.split("/")[-1])
    _check_llm_ids(name, aliases)
    registry.add_model(name, path, stored_source, list(aliases), expert_slots)
    info = registry.describe(config_dict)
    if not info["experts"]:
        click.echo(
            f"Note: {path} has no routed experts; it will run fully resident.", err=True
        )
    shape = f"{info['experts']} experts x {info['layers']} layers" if info["experts"] else "dense"
    click.echo(
        f"Added {registry.MODEL_PREFIX}/{name} ({info['architecture']}, {shape}, "
        f"{_size(registry.dir_size(path))})"
    )


def _check_llm_ids(name: str, aliases) -> None:
    """Aliases are global in llm: refuse ones another model already answers to."""
    for alias in aliases:
        try:
            existing = llm.get_model(alias)
        except llm.UnknownModelError:
            continue
        raise SettingsError(f"Alias '{alias}' is already used by {existing.model_id}")


def _download(repo_id: str) -> Path:
    """Snapshot a Hugging Face repo, offline first (no network when cached)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover
        raise SettingsError("huggingface_hub is not installed; add a local directory instead")
    try:
        cached = Path(snapshot_download(repo_id, allow_patterns=HF_PATTERNS, local_files_only=True))
        registry.read_config(cached)  # a partial snapshot is downloaded again
        return cached
    except (LocalEntryNotFoundError, SettingsError):
        pass
    except Exception as exc:
        raise SettingsError(f"Could not read {repo_id} from the Hugging Face cache: {_line(exc)}")
    click.echo(f"Downloading {repo_id} from Hugging Face...", err=True)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HF_PATTERNS))
    except Exception as exc:
        raise SettingsError(f"Could not download {repo_id}: {_line(exc)}")


@mlxs.command()
@click.argument("name")
def remove(name):
    """Forget a model (its files stay on disk)."""
    canonical, was_default = registry.remove_model(name)
    click.echo(f"Removed {registry.MODEL_PREFIX}/{canonical}")
    if was_default:
        click.echo(f"The default is now the bundled '{BUNDLED_NAME}'", err=True)


@mlxs.command(name="default")
@click.argument("name", required=False)
def default_(name):
    """Show or set the model served by -m mlx-stream."""
    if not name:
        click.echo(registry.default_name())
        return
    canonical = registry.set_default(name)
    click.echo(f"mlx-stream now serves {registry.MODEL_PREFIX}/{canonical}")
