"""`llm mlxs models/add/remove/default`: the registry of models mlx-stream serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import llm

from ..options import registry
from ..checkpoints.config import check_checkpoint, describe, read_config
from ..errors import CheckpointError, SettingsError, one_line
from ..options.knobs import BUNDLED_NAME
from ..options.settings import Settings, load_settings

from .group import mlxs
from ..sizes import format_size
from .common import table
from .lookup import has_packed
from ..checkpoints.default import bundled_path, is_built
from ..checkpoints.integrity import hf_blobs, record_manifest
from .common import ByteProgress


HF_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What mlx-lm itself fetches for a model: weights, configs, tokenizer files.
HF_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]



def _model_rows(settings: Settings) -> list[dict]:
    default = registry.default_name(settings)
    entries = [(BUNDLED_NAME, bundled_path(), [], "bundled demo (copied on first use)", None)]
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
            "tool_calls": None,
            "tool_format": None,
            "problem": None,
        }
        if name == BUNDLED_NAME and not is_built():
            row["problem"] = "not copied yet"
        else:
            try:
                info = describe(read_config(path))
                row.update({k: info[k] for k in ("architecture", "experts", "layers", "top_k")})
                row["size_bytes"] = registry.dir_size(path)
                row["packed"] = has_packed(path)
                row["tool_format"] = tool_call_report(path)
                row["tool_calls"] = row["tool_format"]["name"]
            except CheckpointError as exc:
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
    listing = []
    for r in rows:
        shape = f"{r['experts']} x {r['layers']}" if r["experts"] else "-"
        if r["experts"] is None and r["layers"] and not r["problem"]:
            shape = f"dense x {r['layers']}"
        listing.append(
            [
                ("* " if r["default"] else "  ") + r["model_id"],
                ", ".join(r["aliases"]) or "-",
                r["architecture"] or "-",
                shape,
                str(r["expert_slots"] or "plan"),
                r["tool_calls"] or "-",
                (format_size(r["size_bytes"]) + (" +packed" if r["packed"] else "")) if not r["problem"] else r["problem"],
            ]
        )
    table(["  model", "aliases", "architecture", "experts x layers", "slots", "tool calls", "size"], listing)
    click.echo("* = default, served by -m mlx-stream; slots 'plan' = sized by memory_budget (llm mlxs plan)")
    for r in rows:
        if r["tool_format"] and r["tool_format"]["note"]:
            click.echo(f"{r['model_id']}: no tool-call format learned from its template: {r['tool_format']['note']}")


@mlxs.command(short_help="Add a model: a folder or a Hugging Face repo id.")
@click.argument("source")
@click.option("-a", "--alias", "aliases", multiple=True, help="Alias for the model (repeatable)")
@click.option("--name", help="Name to register it under (default: the directory or repo name)")
@click.option("--expert-slots", type=click.IntRange(1), help="Expert slots per layer for this model (default: the expert_slots setting)")
@click.option("--hash", "hash_", is_flag=True, help="Hash every file now, for `llm mlxs verify` (reads the whole checkpoint)")
def add(source, aliases, name, expert_slots, hash_):
    """Add a model: a local mlx-lm checkpoint directory or a Hugging Face repo id.

    \b
    llm mlxs add ~/models/Qwen3-30B-A3B-4bit -a q30
    llm mlxs add mlx-community/Qwen3-30B-A3B-4bit
    """
    local = Path(source).expanduser()
    if local.exists() or looks_local(source) or not HF_REPO_RE.match(source):
        if not local.exists():
            raise no_folder(source)
        path = local.resolve()
        stored_source = str(path)
    else:
        path = _download(source)
        stored_source = source
    if name is not None and not name.strip():
        raise SettingsError("--name must not be empty")
    config_dict = check_checkpoint(path)
    name = name or re.sub(r"[^A-Za-z0-9._-]", "-", path.name if stored_source == str(path) else source.split("/")[-1])
    _check_llm_ids(name, aliases)
    registry.add_model(name, path, stored_source, list(aliases), expert_slots)
    if hash_:
        _record_hashes(path)
    info = describe(config_dict)
    if not info["experts"]:
        click.echo(
            f"Note: {path} has no routed experts; it will run fully resident.", err=True
        )
    shape = f"{info['experts']} experts x {info['layers']} layers" if info["experts"] else "dense"
    from ..checkpoints.mtp import has_head  # imports mlx: not at `llm --help`

    if has_head(path, config_dict):
        shape += ", an MTP head for -o draft mtp"
    report = tool_call_report(path)
    click.echo(
        f"Added {registry.MODEL_PREFIX}/{name} ({info['architecture']}, {shape}, "
        f"{format_size(registry.dir_size(path))}; tool calls: {report['name'] or 'none'})"
    )
    click.echo(describe_tool_calls(report))


def tool_call_report(path: Path) -> dict:
    """The checkpoint's tool-call format (formats/) as `add` and `models` report it: its
    name, where it comes from ("ours": a module of formats/, "mlx-lm": mlx-lm's parser as
    it is, "learned": from the chat template, "none"), the markup its calls open and
    close with, its reasoning markers, whether tool_choice can be forced, and, where
    learning could not tell, why."""
    from ..formats.registry import checkpoint_finding, checkpoint_reasoning  # imports mlx-lm: not at `llm --help`

    finding = checkpoint_finding(path)
    fmt = finding.format
    reasoning = checkpoint_reasoning(path, fmt)
    return {"name": fmt.name if fmt else None, "origin": fmt.origin if fmt else "none",
            "markup": [fmt.tool_call_start, fmt.tool_call_end] if fmt else None,
            "reasoning": [reasoning.start, reasoning.end] if reasoning else None,
            "forced": bool(fmt and fmt.grammar is not None), "note": finding.note or None}


ORIGINS = {"ours": "a module of ours", "mlx-lm": "mlx-lm's parser, calls given whole", "learned": "learned from the chat template"}


def describe_tool_calls(report: dict) -> str:
    """One line: what `tool_call_report` found."""
    reasoning = f"reasoning {' ... '.join(report['reasoning'])}" if report["reasoning"] else "no reasoning markers"
    if report["origin"] == "none":
        why = f"learning from the template: {report['note']}" if report["note"] else "no tool-call format"
        return f"Tool calls: none ({why}; requests with tools are refused); {reasoning}"
    start, end = report["markup"]
    markup = f"{start} ... {end}" if end else f"{start} ... (the turn's end)"
    forced = "can be forced" if report["forced"] else "cannot be forced (auto only)"
    return (f"Tool calls: {report['name']} ({ORIGINS[report['origin']]}: {markup}); {reasoning}; "
            f"tool_choice required or named {forced}")


def _record_hashes(path: Path) -> None:
    if hf_blobs(path):
        click.echo("Note: the Hugging Face cache already keeps every file's hash; --hash is not needed", err=True)
        return
    bar = ByteProgress("hashing")
    try:
        manifest = record_manifest(path, progress=bar)
    finally:
        bar.close()
    click.echo(f"Recorded the hashes of {path} for `llm mlxs verify` ({manifest})", err=True)


def _check_llm_ids(name: str, aliases) -> None:
    """Aliases are global in llm: refuse ones another model already answers to."""
    for alias in aliases:
        try:
            existing = llm.get_model(alias)
        except llm.UnknownModelError:
            continue
        raise SettingsError(f"Alias '{alias}' is already used by {existing.model_id}")


def looks_local(source: str) -> bool:
    """Whether `source` is written as a path (./, /, ~, a/b/c, or under a folder here), not a
    Hugging Face repo id (org/name)."""
    under = Path(source).parent
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or (under.name != "" and under.is_dir())


def no_folder(source: str) -> SettingsError:
    """The one line for a source that is no folder here (nor, unless written as a path, a repo id)."""
    return SettingsError(f"No such folder: {source}" + ("" if looks_local(source) else
                                                       " (nor a Hugging Face repo id like org/name)"))


def _download(repo_id: str) -> Path:
    """Snapshot a Hugging Face repo, offline first (no network when cached); a download
    says its size first and shows huggingface_hub's progress bars."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover
        raise SettingsError("huggingface_hub is not installed; add a local directory instead")
    try:
        cached = Path(snapshot_download(repo_id, allow_patterns=HF_PATTERNS, local_files_only=True))
        read_config(cached)  # a partial snapshot is downloaded again
        return cached
    except (LocalEntryNotFoundError, CheckpointError):
        pass
    except Exception as exc:
        raise SettingsError(f"Could not read {repo_id} from the Hugging Face cache: {one_line(exc)}")
    try:
        files = [f for f in snapshot_download(repo_id, allow_patterns=HF_PATTERNS, dry_run=True) if f.will_download]
        size = sum(f.file_size or 0 for f in files)
        click.echo(f"Downloading {repo_id} from Hugging Face: {format_size(size)} in {len(files)} files...", err=True)
        return Path(snapshot_download(repo_id, allow_patterns=HF_PATTERNS))
    except Exception as exc:
        raise hub_error(repo_id, exc) from None


def hub_error(repo_id: str, exc: Exception) -> SettingsError:
    """What the Hugging Face Hub answered (or that it could not be reached), in one line
    that names what to do."""
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled, \
        RepositoryNotFoundError

    chain, cause = [], exc
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(e, GatedRepoError) for e in chain):
        return SettingsError(f"{repo_id} is gated on Hugging Face: accept its terms at "
                             f"https://huggingface.co/{repo_id}, then log in with `hf auth login`")
    if any(isinstance(e, RepositoryNotFoundError) for e in chain):
        return SettingsError(f"No folder {repo_id} here, and no model {repo_id} on Hugging Face (a private one "
                             "needs `hf auth login`)")
    if any(isinstance(e, (OfflineModeIsEnabled, LocalEntryNotFoundError, ConnectionError)) or
           type(e).__name__ in ("ConnectError", "ConnectTimeout", "gaierror") for e in chain):
        return SettingsError(f"No folder {repo_id} here, and Hugging Face cannot be reached to download a model of "
                             f"that name ({one_line(chain[-1])}): connect to the network, or give the folder's path")
    return SettingsError(f"Could not download {repo_id}: {one_line(exc)}")


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
