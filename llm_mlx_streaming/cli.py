"""``llm mlxs ...``: settings, the model registry, memory plans, packed stores,
routing traces and figures from logs.db.

``stats`` reads llm's own log database rather than the engine, because each
``llm`` invocation is a new process with no engine in memory; the figures
were stored per response (``response_json``) when it ran. ``plan`` reads only
checkpoint headers; ``simulate`` only trace files. docs/llm-plugin.md documents
every command.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import sys
from pathlib import Path

import click
import llm

from . import registry
from .settings import (
    AUTO_BUDGET_SHARE,
    BUNDLED_NAME,
    CONFIG_KEYS,
    MlxStreamError,
    Settings,
    SettingsError,
    budget_bytes,
    explicit_keys,
    load_settings,
    normalize_budget,
    set_value,
    settings_path,
    trace_file,
    traces_dir,
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
    if isinstance(value, bool):
        return "on" if value else "off"
    return "(unset)" if value is None else str(value)


def _shown(key: str, value) -> str:
    """A setting's value as `config` lists it ("auto" budgets with their size here)."""
    if key == "memory_budget" and value == "auto":
        from .engine.planner import format_size

        try:
            return f"auto ({format_size(budget_bytes(value))})"
        except SettingsError:
            return "auto (unknown memory size)"
    return _fmt(value)


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
        [[r["key"], _shown(r["key"], r["value"]), "default" if r["default"] else "set", r["description"]] for r in rows],
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


# -- checkpoints by name ------------------------------------------------------------


def _checkpoint(name: str | None, settings: Settings) -> tuple[str, Path, object]:
    """(label, checkpoint dir, registry entry or None) for a model name, alias,
    `mlx-stream` (the default model; also when NAME is omitted) or a directory."""
    if name in (None, registry.MODEL_PREFIX):
        canonical = registry.default_name(settings)
    else:
        try:
            canonical = registry.resolve_name(name, settings)
        except SettingsError:
            local = Path(name).expanduser()
            if local.is_dir():
                registry.read_config(local)
                return str(local.resolve()), local.resolve(), None
            known = ", ".join([BUNDLED_NAME, *settings.models])
            raise SettingsError(
                f"Unknown model '{name}' (nor a checkpoint directory). Known models: {known}"
            ) from None
    path, entry = registry.checkpoint_for(canonical, settings)
    return f"{registry.MODEL_PREFIX}/{canonical}", path, entry


def _has_packed(path: Path) -> bool:
    from .experts.packed import INDEX_NAME, packed_dir

    return (packed_dir(path) / INDEX_NAME).is_file()


# -- plan ------------------------------------------------------------------------------


@mlxs.command(short_help="How a memory budget is spent; slots per layer (loads nothing).")
@click.argument("name", required=False)
@click.option("--budget", metavar="SIZE", help="Memory budget, e.g. 12GB or auto (default: the memory_budget setting)")
@click.option("--max-context", type=click.IntRange(1), help="Tokens of KV cache to plan for (default: the max_context setting)")
@click.option("--hit-rate", type=click.FloatRange(0, 1), help="Forecast disk reads per token at this hit rate (default: 0.5, 0.8 and 0.9)")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
def plan(name, budget, max_context, hit_rate, json_):
    """How a memory budget is spent: dense weights, KV cache, reserve, expert slots.

    Reads only config.json and the safetensors headers; loads nothing. NAME is a
    model name or alias, mlx-stream (the default model, also when omitted) or a
    checkpoint directory.

    \b
    llm mlxs plan q30 --budget 12GB
    llm mlxs plan ~/models/Qwen3-30B-A3B-4bit --budget 16GB --max-context 8192 --json
    """
    from .engine.planner import PlanError, plan_memory
    from .experts.index import CheckpointError

    settings = load_settings()
    label, path, entry = _checkpoint(name, settings)
    value = settings.memory_budget if budget is None else budget
    try:
        value = normalize_budget(value)
    except ValueError as exc:
        raise SettingsError(f"Invalid --budget {budget!r}: {exc}") from None
    nbytes = budget_bytes(value)
    context = max_context or settings.max_context
    try:
        result = plan_memory(path, nbytes, max_context=context)
    except PlanError as exc:
        prefix = f"memory_budget auto ({AUTO_BUDGET_SHARE:.0%} of this machine's memory): " if value == "auto" else ""
        raise MlxStreamError(prefix + str(exc)) from None
    except (CheckpointError, ValueError, OSError) as exc:
        raise MlxStreamError(f"Cannot plan {label}: {_line(exc)}") from None
    fixed = None
    if entry is not None or label == f"{registry.MODEL_PREFIX}/{BUNDLED_NAME}":
        canonical = label.split("/", 1)[1]
        fixed = registry.effective_slots(canonical, entry, settings)
    if json_:
        data = result.as_dict()
        data["budget_setting"] = value
        data["model"] = label
        data["expert_slots_in_use"] = fixed
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(format_plan_text(result, hit_rate, value))
    if fixed:
        source = registry.slots_source(canonical, entry, settings)
        why = {"model": "its --expert-slots", "setting": "the expert_slots setting",
               "bundled": "the bundled demo's default"}.get(source, "a setting")
        click.echo(
            f"Note: {label} runs with {fixed} expert slots per layer ({why}), not this plan; "
            f"-o memory_budget {value} uses the plan.",
            err=True,
        )


def format_plan_text(result, hit_rate, value) -> str:
    from .engine.planner import format_plan

    text = format_plan(result, hit_rate=hit_rate)
    if value == "auto":
        text += f"\n  (budget: memory_budget auto = {AUTO_BUDGET_SHARE:.0%} of this machine's memory)"
    return text


# -- pack -----------------------------------------------------------------------------


@mlxs.command(short_help="Pack a model's experts: one read per expert; --verify, --remove.")
@click.argument("name", required=False)
@click.option("--verify", is_flag=True, help="Check the packed store (every record's checksum) instead of packing")
@click.option("--remove", is_flag=True, help="Delete the packed store")
def pack(name, verify, remove):
    """Pack a model's experts into one contiguous record each (one read per expert).

    The packed store is written beside the checkpoint (in mlxs-packed/) and used
    when the packed setting is auto (the default) while it matches the checkpoint.
    NAME as for `llm mlxs plan`.

    \b
    llm mlxs pack q30            write (or rewrite) the store
    llm mlxs pack q30 --verify   check it: prints each problem, or ok
    llm mlxs pack q30 --remove   delete it
    """
    from .experts import packed as packed_mod

    if verify and remove:
        raise click.UsageError("--verify and --remove do not go together")
    settings = load_settings()
    label, path, _ = _checkpoint(name, settings)
    folder = packed_mod.packed_dir(path)
    if remove:
        if not folder.exists():
            raise MlxStreamError(f"{label} has no packed store ({folder})")
        _forget_loaded(path)
        shutil.rmtree(folder)
        click.echo(f"Removed the packed store of {label} ({folder})")
        return
    if verify:
        if not _has_packed(path):
            command = f"llm mlxs pack {name}" if name else "llm mlxs pack"
            raise MlxStreamError(f"{label} has no packed store; write one with `{command}`")
        try:
            problems = packed_mod.verify_packed(path)
        except (ValueError, OSError, KeyError) as exc:
            raise MlxStreamError(f"Cannot verify the packed store of {label}: {_line(exc)}") from None
        for problem in problems:
            click.echo(problem)
        if problems:
            raise MlxStreamError(
                f"the packed store of {label} has {len(problems)} problem"
                f"{'s' if len(problems) != 1 else ''}; run `llm mlxs pack` again to rewrite it"
            )
        click.echo("ok")
        return
    _check_space(path, folder)
    report = _Progress()
    try:
        out = packed_mod.pack_checkpoint(path, progress=report)
    except (ValueError, OSError, KeyError) as exc:
        raise MlxStreamError(f"Cannot pack {label}: {_line(exc)}") from None
    finally:
        report.close()
    _forget_loaded(path)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    click.echo(f"Packed {label}: {report.layers} MoE layers, {_size(size)} in {out}")
    if settings.packed == "off":
        click.echo("Note: the packed setting is off; `llm mlxs config packed auto` uses the store", err=True)


class _Progress:
    """pack_checkpoint's progress: a bar on a terminal, a line per layer otherwise."""

    def __init__(self):
        self.bar = None
        self.layers = 0
        self.done = 0
        self.total = 0
        self.tty = sys.stderr.isatty()

    def __call__(self, layer: int, layers: int, done: int, total: int) -> None:
        if self.tty:
            if self.bar is None:
                self.bar = click.progressbar(length=total, label="packing", file=sys.stderr)
                self.bar.__enter__()
            self.bar.update(done - self.done)
        elif layer != self.layers and self.layers:
            self._line(self.layers, layers, self.done, total)
        self.layers, self.done, self.total = layer, done, total
        self._of = layers

    def _line(self, layer, layers, done, total) -> None:
        click.echo(f"layer {layer}/{layers} packed ({_size(done)} of {_size(total)})", err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
        elif self.layers and self.done == self.total:
            self._line(self.layers, self._of, self.done, self.total)


def _check_space(path: Path, folder: Path) -> None:
    """Refuse to start a pack the disk cannot hold (the store is about the experts' size)."""
    from .engine.planner import checkpoint_layout, format_size
    from .experts.index import CheckpointError
    from .experts.packed import record_size

    try:
        layout = checkpoint_layout(path)
    except (CheckpointError, ValueError, OSError):
        return  # pack_checkpoint reports it
    need = sum(record_size(b) * layout.num_experts for b in layout.expert_bytes)
    if folder.exists():
        need -= sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    free = shutil.disk_usage(path).free
    if need > free:
        raise MlxStreamError(
            f"not enough disk space to pack: the store needs {format_size(need)}, "
            f"{format_size(free)} is free on {path}"
        )


def _forget_loaded(path: Path) -> None:
    """A model loaded in this process (Python callers, tests) reloads on its next
    prompt, so it picks up (or drops) the packed store."""
    manager = sys.modules.get("llm_mlx_streaming.engine.manager")
    if manager is None:
        return
    mgr = manager.get_manager()
    if mgr.checkpoint is not None and mgr.checkpoint == path.expanduser().resolve():
        mgr.unload()


# -- traces and simulate --------------------------------------------------------------


def _trace_path(trace: str) -> tuple[Path, str]:
    """A trace file, or the recorded trace of a model (name, alias or mlx-stream)."""
    local = Path(trace).expanduser()
    if local.is_file():
        return local, str(local)
    settings = load_settings()
    try:
        canonical = (
            registry.default_name(settings)
            if trace == registry.MODEL_PREFIX
            else registry.resolve_name(trace, settings)
        )
    except SettingsError:
        raise SettingsError(f"No such trace file or model: {trace}") from None
    path = trace_file(canonical)
    if not path.is_file():
        raise SettingsError(
            f"No trace recorded for {registry.MODEL_PREFIX}/{canonical} yet ({path}): "
            "run `llm mlxs config trace on`, then some prompts"
        )
    return path, f"{registry.MODEL_PREFIX}/{canonical}"


def _trace_shape(path: Path, phase: str) -> tuple[int, int]:
    """(experts, top_k) of the first line of `phase` in a trace file, (0, 0) if none."""
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return 0, 0  # simulate() names the line
                if isinstance(obj, dict) and obj.get("phase") == phase:
                    return int(obj.get("experts") or 0), int(obj.get("top_k") or 0)
    except (OSError, UnicodeDecodeError, TypeError, ValueError):
        pass
    return 0, 0


def default_slot_sweep(experts: int, top_k: int) -> list[int]:
    """Slot counts worth comparing: every count from top_k up on small models, else
    top_k doubled up to the expert count, and half the experts."""
    top_k = max(1, top_k)
    if experts <= 1:
        return [1]
    if experts <= 16:
        return list(range(min(top_k, experts - 1), experts))
    counts = set()
    n = top_k
    while n < experts:
        counts.add(n)
        n *= 2
    counts.add(experts // 2)
    return sorted(counts)


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise click.BadParameter(f"expected comma-separated counts of at least 1, like 8,16,32; got {text!r}", param_hint=what)
    return values


@mlxs.command(short_help="Replay a routing trace: hit rates of each policy and Belady.")
@click.argument("trace")
@click.option("--slots", help="Comma-separated slot counts, e.g. 8,16,32 (default: a sweep from top_k up)")
@click.option("--policies", default="lru,lfu,lfuda", show_default=True, help="Comma-separated policies to compare with LRU and Belady")
@click.option("--phase", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True, help="Which recorded phase to replay")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
def simulate(trace, slots, policies, phase, json_):
    """Replay a routing trace through each eviction policy and Belady's optimum.

    TRACE is a trace file (JSON lines) or a model name, meaning the trace recorded
    for it while the trace setting was on (see `llm mlxs traces`).

    \b
    llm mlxs simulate q30 --slots 16,32,64
    llm mlxs simulate ../shared/traces/mixtral.jsonl --slots 2,4,6 --json
    """
    from .experts.simulate import format_table
    from .experts.simulate import simulate as run_simulation

    path, label = _trace_path(trace)
    if slots:
        counts = _int_list(slots, "--slots")
    else:
        experts, top_k = _trace_shape(path, phase)
        counts = default_slot_sweep(experts, top_k) if experts else [1]
    names = [p for p in policies.replace(" ", "").lower().split(",") if p]
    try:
        rows = run_simulation(path, counts, policies=names, phase=phase)
    except ValueError as exc:
        raise MlxStreamError(_line(exc)) from None
    if json_:
        click.echo(json.dumps({"trace": str(path), "phase": phase, "rows": rows}, indent=2))
        return
    click.echo(f"{label} ({phase})")
    click.echo(format_table(rows))


@mlxs.command()
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
def traces(json_):
    """List the routing traces recorded while the trace setting was on."""
    folder = traces_dir()
    rows = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        counts = {"decode": 0, "prefill": 0}
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                match = re.search(r'"phase":\s*"(\w+)"', line)
                if match and match.group(1) in counts:
                    counts[match.group(1)] += 1
        rows.append({"model": path.stem, "path": str(path), "size_bytes": path.stat().st_size,
                     "decode_sequences": counts["decode"], "prefill_sequences": counts["prefill"]})
    if json_:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo(f"No traces in {folder} (turn recording on with `llm mlxs config trace on`)", err=True)
        return
    _table(["model", "decode", "prefill", "size", "file"],
           [[r["model"], str(r["decode_sequences"]), str(r["prefill_sequences"]), _size(r["size_bytes"]), r["path"]] for r in rows])



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
        "read_mb_per_s": round(total("mb_read") / total("read_seconds"), 1) if total("read_seconds") else None,
        **{k: total(k) for k in _prefetch_keys(s)},
        "unplaced": total("unplaced"),
        "peak_memory_bytes": max((_num(x, "peak_memory_bytes") for x in s), default=0),
    }


def _prefetch_keys(stats: list[dict]) -> list[str]:
    """prefetch_* counters some responses carry (summed; rates are left out)."""
    keys = {k for x in stats for k, v in x.items()
            if k.startswith("prefetch_") and isinstance(v, (int, float)) and not isinstance(v, bool)
            and not k.endswith(("_rate", "_ratio"))}
    return sorted(keys)


def _slots_text(slots) -> str:
    if isinstance(slots, list) and slots:
        return str(slots[0]) if len(set(slots)) == 1 else f"{min(slots)}-{max(slots)}"
    return "-" if slots is None else str(slots)


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
    if st.get("read_mb_per_s") is not None:
        lines[6][1] += f" ({n('read_mb_per_s', '{} MB/s')})"
    if "mb_read_per_token" in st:
        lines.insert(7, ["read per token", n("mb_read_per_token", "{} MB")])
    prefetch = [k for k in st if k.startswith("prefetch_") and st[k] is not None]
    if prefetch:
        lines.append(["prefetch", ", ".join(f"{k.removeprefix('prefetch_').replace('_', ' ')} {st[k]}" for k in sorted(prefetch))])
    if "expert_slots" in st or "policy" in st:
        policy = st.get("policy") if isinstance(st.get("policy"), str) else "-"
        source = {"plan": "memory plan", "model": "model's --expert-slots", "setting": "expert_slots setting",
                  "bundled": "bundled default", "option": "-o expert_slots"}.get(st.get("slots_from"))
        lines.append(["pool", f"{_slots_text(st.get('expert_slots'))} slots per layer, {policy}"
                      + (f" ({source})" if source else "")])
    if isinstance(st.get("store"), str):
        extra = []
        if st.get("threads"):
            extra.append(f"{st['threads']} threads")
        if isinstance(st.get("page_cache"), str):
            extra.append(f"page cache {st['page_cache']}")
        lines.append(["expert reads", st["store"] + (f" ({', '.join(extra)})" if extra else "")])
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
