"""Which layers each rank holds, and the check that every rank reads the same checkpoint.

mlx-lm's pipeline (`model.model.pipeline(group, split)`) gives rank 0 the last layers
and the highest rank the first. The default split here weighs each decoder layer by its
experts' bytes (plus its dense bytes), so ranks hold about equal shares of what pools
stream, in proportion to their memory budgets when those are given.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Sequence

from ..engine.footprint import checkpoint_layout
from ..errors import CheckpointError

_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_weights(path: str | Path) -> list[int]:
    """Bytes per decoder layer that a rank holds for it: all its experts (what its pool
    streams) plus an even share of the dense bytes, so a dense layer still counts."""
    layout = checkpoint_layout(path)
    from ..checkpoints.config import decoder_shape

    num_layers = decoder_shape(layout.config)[0] or len(layout.layer_keys)
    weights = [max(1, layout.dense_bytes // max(1, num_layers))] * num_layers
    for key, per_expert in zip(layout.layer_keys, layout.expert_bytes):
        m = _LAYER.search(key)
        if m and int(m.group(1)) < num_layers:
            weights[int(m.group(1))] += per_expert * layout.num_experts
    return weights


def balanced_split(weights: Sequence[int], budgets: Sequence[float]) -> list[int]:
    """Layers per rank (mlx-lm's order: entry r is rank r's count, rank 0 holding the
    last layers), contiguous, each rank's share of `weights` near its share of
    `budgets`, every rank at least one layer."""
    n = len(budgets)
    if n > len(weights):
        raise ValueError(f"{n} ranks but only {len(weights)} layers")
    order = list(range(n - 1, -1, -1))  # the highest rank takes the first layers
    total, budget = sum(weights), sum(budgets)
    counts, start, done = [], 0, 0.0
    for i, rank in enumerate(order):
        left = n - i - 1  # ranks after this one, each needing a layer
        if left == 0:
            counts.append(len(weights) - start)
            break
        done += budgets[rank] / budget * total
        end, acc = start + 1, sum(weights[: start + 1])
        while end < len(weights) - left and abs(acc + weights[end] - done) <= abs(acc - done):
            acc += weights[end]
            end += 1
        counts.append(end - start)
        start = end
    return list(reversed(counts))  # back to rank order


def layer_range(split: Sequence[int], rank: int) -> tuple[int, int]:
    """[start, end) of the decoder layers `rank` holds under `split`."""
    start = sum(split[rank + 1:])
    return start, start + split[rank]


def own_slots(path: str | Path, slots, split: Sequence[int], rank: int):
    """A rank's part of `slots`: a count (or None) as it is; `{"ranks": [...]}` (each
    rank's own plan) its entry; a list of one count per MoE layer of the whole model (a
    one-machine memory plan) cut to the rank's MoE layers."""
    if isinstance(slots, dict):
        return slots["ranks"][rank]
    if not isinstance(slots, (list, tuple)):
        return slots
    keys = checkpoint_layout(path).layer_keys
    if len(slots) != len(keys):
        raise ValueError(f"{len(slots)} slot counts given for {len(keys)} MoE layers")
    start, end = layer_range(split, rank)
    return [n for n, key in zip(slots, keys) if start <= int(_LAYER.search(key).group(1)) < end]


def pipeline_hook(group, split: Sequence[int]):
    """For `load_streaming(prepare=...)`: cut the lazily built model to this rank's layers
    before any tensor is read, or refuse a family mlx-lm cannot pipeline."""

    def prepare(model) -> None:
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise CheckpointError(
                f"{type(model).__module__.rsplit('.', 1)[-1]}: mlx-lm has no pipeline split for this family"
            )
        inner.pipeline(group, list(split))

    return prepare


def content_fingerprint(path: str | Path) -> str:
    """A hash of the checkpoint's bytes as every machine sees them (sizes, headers and
    sampled blocks of each shard, config.json): inode and times differ between copies."""
    from ..experts.packed import fingerprint

    digest = hashlib.sha256((Path(path).expanduser() / "config.json").read_bytes())
    for name, shard in sorted(fingerprint(path).items()):
        digest.update(json.dumps([name, shard["size"], shard["header_len"], shard["sample"]]).encode())
    return digest.hexdigest()[:16]
