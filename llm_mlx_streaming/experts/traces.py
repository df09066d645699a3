"""The routing-trace file: what `-o trace` records and `llm mlxs simulate` replays.

A trace is a JSON-lines file, one routed sequence (one prompt's decode, or one prefill) per
line, the same format as the shared Mixtral trace so one reader serves both:

    {"model": "...", "layers": 32, "experts": 8, "top_k": 2, "phase": "decode",
     "layer_seqs": [[[6, 5], [3, 1], ...], ...]}

``layer_seqs[l][t]`` is the list of expert ids layer ``l`` routed to at step ``t``, in
router-rank order (highest gate first); a step may be ``null`` (not recorded: skipped). Lines
without ``layer_seqs`` but with the step-major ``steps[t][l]`` (the shared prefill line) are
read too. Other fields are kept as metadata.

A malformed line is refused with the file and line number, so a trace from another
tool fails in one line instead of skewing a replay.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Optional

Step = Optional[list[int]]  # expert ids in router-rank order; None = not recorded
PHASES = ("decode", "prefill")
RECORDED = Path(__file__).parent / "recorded"  # the traces the package ships (their NOTICE says whence)


def bundled_traces() -> dict[str, Path]:
    """The traces shipped with the package, by name (`llm mlxs simulate NAME`)."""
    return {path.stem: path for path in sorted(RECORDED.glob("*.jsonl"))}


@dataclass
class Sequence:
    """One trace line: the routed experts of every layer, step by step."""

    layers: int
    experts: int
    top_k: int
    phase: str
    layer_seqs: list[list[Step]]  # [layer][step] -> expert ids or None
    model: Optional[str] = None
    meta: dict[str, Any] = field(default_factory=dict)  # the line's other fields

    @property
    def steps(self) -> int:
        return max((len(s) for s in self.layer_seqs), default=0)


def _to_int_list(step, where: str) -> Step:
    if step is None:
        return None
    if hasattr(step, "tolist"):  # numpy / mlx arrays
        step = step.tolist()
    try:
        out = [int(e) for e in step]
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: a step must be a list of expert ids or null, got {step!r}"
        ) from None
    return out


def write_trace_line(
    fh: IO[str],
    *,
    model: Optional[str],
    layers: int,
    experts: int,
    top_k: int,
    phase: str,
    layer_seqs: Iterable[Iterable[Any]],
) -> None:
    """Append one sequence to an open text trace file (one JSON object, one line).

    ``layer_seqs[l][t]`` is the expert ids of layer ``l`` at step ``t`` in router-rank order
    (lists, tuples, or numpy/mlx arrays), or None for a step that was not recorded.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    seqs = [
        [_to_int_list(s, f"layer {li} step {t}") for t, s in enumerate(layer)]
        for li, layer in enumerate(layer_seqs)
    ]
    if len(seqs) != int(layers):
        raise ValueError(f"layer_seqs has {len(seqs)} layers, expected layers={layers}")
    obj = {
        "model": model,
        "layers": int(layers),
        "experts": int(experts),
        "top_k": int(top_k),
        "phase": phase,
        "layer_seqs": seqs,
    }
    fh.write(json.dumps(obj, separators=(",", ":")) + "\n")


def _parse_line(obj: Any, where: str) -> Sequence:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    try:
        layers = int(obj["layers"])
        experts = int(obj["experts"])
        top_k = int(obj["top_k"])
        phase = obj["phase"]
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{where}: layers, experts and top_k must be integers") from None
    if layers < 1 or experts < 1 or top_k < 1:
        raise ValueError(f"{where}: layers, experts and top_k must be >= 1")
    if "layer_seqs" in obj:
        raw = obj["layer_seqs"]
        if not isinstance(raw, list) or not all(isinstance(x, list) for x in raw):
            raise ValueError(f"{where}: layer_seqs must be a list (per layer) of lists (per step)")
    elif "steps" in obj:  # step-major steps[t][l] (the shared prefill line)
        steps = obj["steps"]
        if not isinstance(steps, list) or not all(
            isinstance(s, list) and len(s) == layers for s in steps
        ):
            raise ValueError(f"{where}: steps must be a list (per step) of {layers} entries")
        raw = [[s[li] for s in steps] for li in range(layers)]
    else:
        raise ValueError(f"{where}: missing field 'layer_seqs'")
    if len(raw) != layers:
        raise ValueError(f"{where}: layer_seqs has {len(raw)} layers, the line says {layers}")
    layer_seqs = []
    for li, layer in enumerate(raw):
        out = []
        for t, s in enumerate(layer):
            if s is not None and not isinstance(s, list):
                raise ValueError(f"{where}: layer {li} step {t} is not a list or null")
            step = _to_int_list(s, f"{where}: layer {li} step {t}")
            if step is not None and any(e < 0 or e >= experts for e in step):
                raise ValueError(
                    f"{where}: layer {li} step {t} has an expert id outside "
                    f"0..{experts - 1}: {step}"
                )
            out.append(step)
        layer_seqs.append(out)
    known = {"model", "layers", "experts", "top_k", "phase", "layer_seqs", "steps"}
    return Sequence(
        layers=layers,
        experts=experts,
        top_k=top_k,
        phase=phase,
        layer_seqs=layer_seqs,
        model=obj.get("model"),
        meta={k: v for k, v in obj.items() if k not in known and k != "layer_gating_probs"},
    )


def load_trace(path, phase: Optional[str] = "decode") -> list[Sequence]:
    """The sequences of one phase ("decode", "prefill"; None = all) in a trace file.

    Raises ValueError, naming the file, if it is missing, unreadable or malformed.
    """
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)} or None, got {phase!r}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"trace file not found: {path}")
    out: list[Sequence] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
                if isinstance(obj, dict) and phase is not None and obj.get("phase") != phase:
                    continue
                out.append(_parse_line(obj, where))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read trace file {path}: {e}") from None
    return out
