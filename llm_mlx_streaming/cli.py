"""``llm mlxs ...``: settings, the model registry, and figures from logs.db.

``stats`` reads llm's own log database rather than the engine, because each
``llm`` invocation is a new process with no engine in memory; the figures
were stored per response (``response_json``) when it ran.
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import click
import llm

from . import registry
from .settings import (
    BUNDLED_NAME,
    CONFIG_KEYS,
    Settings,
    SettingsError,
    explicit_keys,
    load_settings,
    set_value,
    settings_path,
    unset_value,
)

HF_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What mlx-lm itself fetches for a model: weights, configs, tokenizer files.
HF_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def register(cli: click.Group) -> None:
    cli.add_command(mlxs)


@click.group()
def mlxs():
    """Stream Mixture-of-Experts models from disk with MLX (model: mlx-stream)."""


# -- config ----------------------------------------------------------------


def _fmt(value) -> str:
    return "(unset)" if value is None else str(value)


@mlxs.command()
@click.argument("key", required=False)
@click.argument("value", required=False)
@click.option("--unset", "unset_key", metavar="KEY", help="Reset KEY to its default")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
def config(key, value, unset_key, json_):
    """Show or change settings.

    \b
    llm mlxs config                 every setting, its value, default or set
    llm mlxs config KEY             one setting
    llm mlxs config KEY VALUE       validate and save
    llm mlxs config --unset KEY     back to the default
    """
    if unset_key:
        if key or value:
            raise click.UsageError("--unset takes only the KEY")
        unset_value(unset_key)
        click.echo(f"{unset_key} reset to its default", err=True)
        return
    if key and value is not None:
        settings = set_value(key, value)
        click.echo(f"{key} = {_fmt(getattr(settings, key))}", err=True)
        return
    settings = load_settings()
    explicit = explicit_keys()
    if key:
        if key not in CONFIG_KEYS:
            raise SettingsError(f"Unknown setting '{key}'. Settings: {', '.join(CONFIG_KEYS)}")
        click.echo(_fmt(getattr(settings, key)))
        return
    rows = [
        {
            "key": k,
            "value": getattr(settings, k),
            "default": k not in explicit,
            "description": Settings.model_fields[k].description,
        }
        for k in CONFIG_KEYS
    ]
    if json_:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"Settings file: {settings_path()}")
    _table(
        ["setting", "value", "", "description"],
        [[r["key"], _fmt(r["value"]), "default" if r["default"] else "set", r["description"]] for r in rows],
    )


# -- models ----------------------------------------------------------------


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _model_rows(settings: Settings) -> list[dict]:
    from .checkpoints.default import bundled_path, is_built

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
            "problem": None,
        }
        if name == BUNDLED_NAME and not is_built():
            row["problem"] = "not built yet"
        else:
            try:
                row.update(registry.describe(registry.read_config(path)))
                row["size_bytes"] = registry.dir_size(path)
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
                str(r["expert_slots"] or "all"),
                _size(r["size_bytes"]) if not r["problem"] else r["problem"],
            ]
        )
    _table(["  model", "aliases", "architecture", "experts x layers", "slots", "size"], table)
    click.echo("* = default, served by -m mlx-stream")


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


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


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


# -- stats -----------------------------------------------------------------


def _logged(db_path: Path, limit: int) -> list[dict]:
    if not db_path.exists():
        return []
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute(
            """select id, model, resolved_model, input_tokens, output_tokens,
                      duration_ms, datetime_utc, response_json
               from turns where model = ? or model like ?
               order by datetime_utc desc, id desc limit ?""",
            [registry.MODEL_PREFIX, registry.MODEL_PREFIX + "/%", limit],
        ).fetchall()
    except sqlite3.OperationalError:  # no turns table yet
        return []
    finally:
        conn.close()
    out = []
    for row in rows:
        item = dict(row)
        try:
            stats = json.loads(item.pop("response_json") or "{}")
        except json.JSONDecodeError:
            stats = {}
        item["stats"] = stats if isinstance(stats, dict) else {}
        out.append(item)
    return out


def _num(stats: dict, key: str) -> float:
    value = stats.get(key)
    return value if isinstance(value, (int, float)) else 0


def aggregate(rows: list[dict]) -> dict:
    """Totals over responses: rates are ratios of sums, not means of ratios."""
    s = [r["stats"] for r in rows]
    total = lambda k: sum(_num(x, k) for x in s)  # noqa: E731
    decode_seconds = sum(
        _num(x, "generated_tokens") / x["decode_tps"] for x in s if _num(x, "decode_tps")
    )
    prefill_seconds = sum(
        _num(x, "prefilled_tokens") / x["prefill_tps"] for x in s if _num(x, "prefill_tps")
    )
    lookups = total("hits") + total("misses")
    generated = total("generated_tokens")
    return {
        "responses": len(rows),
        "prompt_tokens": total("prompt_tokens"),
        "reused_tokens": total("reused_tokens"),
        "prefilled_tokens": total("prefilled_tokens"),
        "generated_tokens": generated,
        "prefill_tps": round(total("prefilled_tokens") / prefill_seconds, 2) if prefill_seconds else None,
        "decode_tps": round(generated / decode_seconds, 2) if decode_seconds else None,
        "hits": total("hits"),
        "misses": total("misses"),
        "hit_rate": round(total("hits") / lookups, 4) if lookups else None,
        "evictions": total("evictions"),
        "mb_read": round(total("mb_read"), 3),
        "mb_read_per_token": round(total("mb_read") / generated, 3) if generated else None,
        "read_seconds": round(total("read_seconds"), 4),
        "unplaced": total("unplaced"),
        "peak_memory_bytes": max((_num(x, "peak_memory_bytes") for x in s), default=0),
    }


def _stat_lines(st: dict) -> list[list[str]]:
    def n(key, fmt="{}"):
        v = st.get(key)
        return "-" if v is None else fmt.format(v)

    hit_rate = st.get("hit_rate")
    lines = [
        ["prompt tokens", f"{n('prompt_tokens')} (reused {n('reused_tokens')}, prefilled {n('prefilled_tokens')})"],
        ["generated tokens", n("generated_tokens") + (f" (finish: {st['finish_reason']})" if isinstance(st.get("finish_reason"), str) else "")],
        ["prefill", n("prefill_tps", "{} tok/s")],
        ["decode", n("decode_tps", "{} tok/s")],
        ["expert hits", f"{n('hits')} hits, {n('misses')} misses"
         + (f" ({hit_rate * 100:.1f}% hit rate)" if isinstance(hit_rate, (int, float)) else "")],
        ["evictions", n("evictions")],
        ["read from disk", f"{n('mb_read', '{} MB')} in {n('read_seconds', '{} s')}"],
        ["unplaced routes", n("unplaced")],
        ["peak memory", _size(st.get("peak_memory_bytes")) if st.get("peak_memory_bytes") is not None else "-"],
    ]
    if "mb_read_per_token" in st:
        lines.insert(7, ["read per token", n("mb_read_per_token", "{} MB")])
    if "expert_slots" in st or "policy" in st:
        policy = st.get("policy") if isinstance(st.get("policy"), str) else "-"
        lines.append(["pool", f"{n('expert_slots')} slots per layer, {policy}"])
    return lines


@mlxs.command()
@click.option("-n", "--count", "count", default=10, show_default=True, type=click.IntRange(1), help="Aggregate over the last N responses")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
@click.option("-d", "--database", type=click.Path(dir_okay=False, path_type=Path), help="Path to log database (default: llm's logs.db)")
def stats(count, json_, database):
    """Engine figures of the last mlx-stream response, and totals over the last N."""
    db_path = database or (llm.user_dir() / "logs.db")
    rows = _logged(db_path, count)
    if not rows:
        if json_:
            click.echo(json.dumps({"last": None, "aggregate": None}))
            return
        raise click.ClickException(f"No mlx-stream responses logged yet in {db_path}")
    last = rows[0]
    agg = aggregate(rows)
    if json_:
        click.echo(json.dumps({"last": last, "aggregate": agg}, indent=2))
        return
    when = (last["datetime_utc"] or "")[:19].replace("T", " ")
    click.echo(f"Last response  {last['model']}  {when} UTC  ({last['duration_ms']} ms)")
    if last.get("resolved_model"):
        click.echo(f"  checkpoint: {last['resolved_model']}")
    _table(None, _stat_lines(last["stats"]), indent="  ")
    click.echo(f"\nLast {agg['responses']} response{'s' if agg['responses'] != 1 else ''}")
    _table(None, _stat_lines(agg), indent="  ")


# -- output ----------------------------------------------------------------


def _table(headers, rows, indent: str = "") -> None:
    all_rows = ([headers] if headers else []) + rows
    if not all_rows:
        return
    widths = [max(len(str(r[i])) for r in all_rows) for i in range(len(all_rows[0]) - 1)]
    for r in all_rows:
        cells = [str(c).ljust(w) for c, w in zip(r, widths)] + [str(r[-1])]
        click.echo((indent + "  ".join(cells)).rstrip())
