"""`llm mlxs simulate` and `traces`: eviction policies replayed on recorded routing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from ..errors import MlxStreamError, one_line
from ..options.knobs import POLICY_NAMES
from ..options.settings import traces_dir

from .group import mlxs
from ..sizes import format_size
from .common import table
from ..experts.simulate import format_table, simulate as run_simulation
from ..experts.traces import RECORDED, bundled_traces
from .lookup import trace_path
from .plot import check_path, plot_simulation


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


@mlxs.command(short_help="Replay a routing trace through each policy.")
@click.argument("trace")
@click.option("--slots", help="Comma-separated slot counts, e.g. 8,16,32 (default: a sweep from top_k up)")
@click.option("--policies", default=",".join(POLICY_NAMES), show_default=True, help="Comma-separated policies to compare with LRU and Belady")
@click.option("--phase", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True, help="Which recorded phase to replay")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw hit rate against pool size (and the first policy's heatmap) into FILE.svg or FILE.png")
def simulate(trace, slots, policies, phase, json_, plot):
    """Replay a routing trace through each eviction policy and Belady's optimum.

    TRACE is a trace file (JSON lines), a model name, meaning the trace recorded
    for it while the trace setting was on, or the name of a trace shipped with the
    plugin: mixtral-8x7b (a real Mixtral-8x7B's routing), demo (the bundled demo's).
    `llm mlxs traces` lists them.

    \b
    llm mlxs simulate q30 --slots 16,32,64
    llm mlxs simulate mixtral-8x7b --slots 2,4,6 --json
    llm mlxs simulate demo --slots 4,8
    """
    check_path(plot)
    path, label = trace_path(trace)
    if slots:
        counts = _int_list(slots, "--slots")
    else:
        experts, top_k = _trace_shape(path, phase)
        counts = default_slot_sweep(experts, top_k) if experts else [1]
    names = [p for p in policies.replace(" ", "").lower().split(",") if p]
    try:
        rows = run_simulation(path, counts, policies=names, phase=phase)
    except ValueError as exc:
        raise MlxStreamError(one_line(exc)) from None
    if plot is not None:
        plot_simulation(label, path, rows, names[0] if names else "lru", phase, plot)
    if json_:
        click.echo(json.dumps({"trace": str(path), "phase": phase, "rows": rows}, indent=2))
        return
    click.echo(f"{label} ({phase})")
    click.echo(format_table(rows))


@mlxs.command(short_help="List the routing traces to replay.")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
def traces(json_):
    """List the routing traces recorded while the trace setting was on, and those shipped
    with the plugin (`llm mlxs simulate NAME` replays one)."""
    folder = traces_dir()
    rows = []
    recorded = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    for path in [*recorded, *bundled_traces().values()]:
        counts = {"decode": 0, "prefill": 0}
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                match = re.search(r'"phase":\s*"(\w+)"', line)
                if match and match.group(1) in counts:
                    counts[match.group(1)] += 1
        rows.append({"model": path.stem, "shipped": path.parent == RECORDED, "path": str(path),
                     "size_bytes": path.stat().st_size,
                     "decode_sequences": counts["decode"], "prefill_sequences": counts["prefill"]})
    if json_:
        click.echo(json.dumps(rows, indent=2))
        return
    table(["trace", "decode", "prefill", "size", "file"],
          [[r["model"] + (" (shipped)" if r["shipped"] else ""), str(r["decode_sequences"]),
            str(r["prefill_sequences"]), format_size(r["size_bytes"]), r["path"]] for r in rows])
    if not recorded:
        click.echo(f"No traces recorded in {folder} yet (turn recording on with `llm mlxs config trace on`)",
                   err=True)
