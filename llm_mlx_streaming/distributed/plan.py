"""A memory plan per rank: each host's budget spent on its own layers (engine/planner.py
on the part of the checkpoint the rank holds), the layers split as the engine splits
them."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from ..checkpoints.config import decoder_shape
from ..engine.footprint import checkpoint_layout
from ..engine.planner import Plan, plan_memory
from ..experts.index import CheckpointIndex
from .split import balanced_split, layer_range, layer_weights

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class RankPlan:
    rank: int
    layers: tuple[int, int]  # [start, end) of the decoder layers it holds
    plan: Plan

    @property
    def expected_hit_rate(self) -> float | None:
        """Slots over experts, averaged over its MoE layers: the hit rate of routing
        that is uniform and independent between tokens (real routing does better)."""
        p = self.plan
        return sum(p.slots_per_layer) / (p.num_experts * p.num_moe_layers) if p.num_moe_layers else None


def plan_ranks(path: str | Path, budgets: Sequence[int], **options) -> list[RankPlan]:
    """One plan per rank (rank 0 first), `budgets` in bytes; `options` as plan_memory's."""
    layout = checkpoint_layout(path)
    num_layers = decoder_shape(layout.config)[0] or len(layout.layer_keys)
    split = balanced_split(layer_weights(path), [float(b) for b in budgets])
    dense, shared = [0] * num_layers, 0
    for key, entry in CheckpointIndex(layout.path).tensors.items():
        m = _LAYER.search(key)
        if key.startswith("mtp.") or ".mtp." in key:
            continue  # an MTP head mlx-lm drops on load
        if m is None:
            shared += entry.nbytes
        elif int(m.group(1)) < num_layers:
            dense[int(m.group(1))] += entry.nbytes
    keys = [int(_LAYER.search(k).group(1)) for k in layout.layer_keys]
    for i, per_expert in zip(keys, layout.expert_bytes):
        dense[i] -= per_expert * layout.num_experts
    out = []
    for rank, budget in enumerate(budgets):
        start, end = layer_range(split, rank)
        own = [j for j, i in enumerate(keys) if start <= i < end]
        config = {**layout.config, "num_hidden_layers": end - start}
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][start:end]
        part = replace(layout, config=config, dense_bytes=shared + sum(dense[start:end]),
                       layer_keys=[layout.layer_keys[j] for j in own],
                       expert_bytes=[layout.expert_bytes[j] for j in own])
        out.append(RankPlan(rank, (start, end), plan_memory(path, budget, layout=part, **options)))
    return out
