"""`--plot FILE.svg|png` of `llm mlxs stats` and `llm mlxs simulate`: the pictures of
llm_mlx_streaming/pictures/, from logs.db, the running server or a replayed trace."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import MlxStreamError, SettingsError, one_line

FORMATS = (".svg", ".png")


def check_path(path: Path | None) -> None:
    """A picture is written as .svg or .png (refused before any work)."""
    if path is not None and path.suffix.lower() not in FORMATS:
        raise click.BadParameter(f"{path.name}: write the picture as FILE.svg or FILE.png", param_hint="--plot")


def _write(drawing, path: Path) -> None:
    try:
        drawing.write(path)
    except OSError as e:
        raise MlxStreamError(f"Cannot write {path}: {e.strerror or one_line(e)}") from None
    click.echo(f"Wrote {path} ({drawing.width}x{drawing.height})", err=True)


def plot_logged(rows: list[dict], path: Path) -> None:
    """The last responses' curves (logs.db, oldest first) and, when the trace setting
    recorded its routing, the heatmap of the last response's routing replayed."""
    from ..pictures import stats_picture

    last = rows[0]
    heat = _last_traced(last)
    subtitle = (f"{last['model']}, the last {len(rows)} logged response{'s' if len(rows) != 1 else ''}"
                + ("" if heat else "; no routing trace recorded for a heatmap (`llm mlxs config trace on`, "
                                   "or --live for a running server's pools)"))
    picture = stats_picture("mlx-stream: the last responses", subtitle, [r["stats"] for r in reversed(rows)], heat)
    _write(picture, path)


def _last_traced(last: dict) -> dict | None:
    """The routing of the last traced response (its prefill and decode lines), replayed
    through pools of the response's slots and policy; None without a trace."""
    from ..experts.traces import Sequence, load_trace
    from ..pictures import replayed_heat
    from ..options.registry import MODEL_PREFIX
    from .lookup import trace_path

    model = last["model"] or MODEL_PREFIX
    try:
        path, _ = trace_path(model.removeprefix(MODEL_PREFIX + "/") if model != MODEL_PREFIX else model)
        lines = load_trace(path, phase=None)
    except (SettingsError, ValueError):
        return None
    if not lines:
        return None
    picked = [lines[-1]]
    if lines[-1].phase == "decode" and len(lines) > 1 and lines[-2].phase == "prefill":
        picked.insert(0, lines[-2])
    layers = max(s.layers for s in picked)
    merged = Sequence(layers=layers, experts=max(s.experts for s in picked), top_k=max(s.top_k for s in picked),
                      phase="decode", layer_seqs=[sum((s.layer_seqs[i] for s in picked if i < len(s.layer_seqs)), [])
                                                  for i in range(layers)])
    st = last["stats"]
    slots, policy = st.get("expert_slots"), st.get("policy") or "lru"
    return replayed_heat([merged], slots, policy, "routing of the last traced response, replayed",
                         f"{' and '.join(s.phase for s in picked)} of {path.name}, through pools of "
                         f"{slots if slots is not None else 'every'} slots ({policy}), from cold")


def plot_live(server, path: Path) -> None:
    """The running server's pools (residency, hits, misses per expert) and its last responses."""
    from ..pictures import live_heat, stats_picture

    frame = server.snapshot()
    recent = frame.get("recent") or []
    subtitle = (f"{frame.get('model') or '-'} on {server.url}: {frame.get('hits') or 0} hits, "
                f"{frame.get('misses') or 0} misses since the load; curves of its last {len(recent)} responses")
    _write(stats_picture("mlx-stream: the running server", subtitle, recent, live_heat(frame)), path)


def plot_simulation(label: str, path_in, rows: list[dict], policy: str, phase: str, path: Path) -> None:
    """Hit rate against pool size for each policy and Belady; the heatmap of the trace
    replayed with `policy` at the middle one of the slot counts."""
    from ..experts.traces import load_trace
    from ..pictures import replayed_heat, simulate_picture

    slots = rows[len(rows) // 2]["slots"]
    heat = replayed_heat(load_trace(path_in, phase=phase), slots, policy,
                         f"{phase} routing replayed at {slots} slots per layer ({policy})",
                         "each sequence from cold; cells: lookups (blue) and the share that missed (red)")
    _write(simulate_picture(f"{label} ({phase})", rows, heat), path)
