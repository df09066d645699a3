"""How one memory budget is split among the models the engine holds.

Each model needs its fixed part (dense weights, KV cache) and at least `floor` (top_k)
slots in every MoE layer; what the budget leaves above that goes first to the pinned
models' pools (models named at the server's start: they shrink last), then to the
others, max-min fair within each, each capped at the slots it asked for. The split depends only on
the set of models, so requests that alternate between resident models never rebuild a
pool: pools change only when a model joins or leaves. Pure arithmetic, no mlx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .footprint import Footprint


@dataclass(frozen=True)
class Claim:
    """A model's footprint, the slots per MoE layer it asked for, and whether it is pinned."""

    footprint: Footprint
    wanted: tuple[int, ...]
    pinned: bool = False

    @property
    def floor(self) -> tuple[int, ...]:
        return tuple(min(w, self.footprint.floor) for w in self.wanted)


def claim_of(spec, pinned: bool = False) -> Claim | None:
    """A LoadSpec's claim on the shared budget; None when it is not budgeted (no footprint)."""
    if spec.footprint is None:
        return None
    return Claim(spec.footprint, wanted_slots(spec.footprint, spec.expert_slots), pinned)


def wanted_slots(footprint: Footprint, expert_slots) -> tuple[int, ...]:
    """Slots per MoE layer of a LoadSpec's `expert_slots` (None: every expert)."""
    layers = len(footprint.expert_bytes)
    if expert_slots is None:
        return (footprint.num_experts,) * layers
    if isinstance(expert_slots, int):
        return (min(expert_slots, footprint.num_experts),) * layers
    return tuple(min(int(s), footprint.num_experts) for s in expert_slots)


def pool_bytes(footprint: Footprint, slots: Sequence[int]) -> int:
    return sum(s * b for s, b in zip(slots, footprint.expert_bytes))


def least_bytes(claims: Sequence[Claim]) -> int:
    """The smallest budget that holds every claim at its floor."""
    if not claims:
        return 0
    fixed = sum(c.footprint.fixed_bytes + pool_bytes(c.footprint, c.floor) for c in claims)
    return fixed + max(c.footprint.reserve_bytes for c in claims)


def split(budget: int, claims: Sequence[Claim]) -> list[tuple[int, ...]] | None:
    """Slots per MoE layer for each claim (in order) within `budget`; None when even
    every floor does not fit."""
    left = budget - least_bytes(claims)
    if left < 0:
        return None
    extras = [pool_bytes(c.footprint, c.wanted) - pool_bytes(c.footprint, c.floor) for c in claims]
    given = [0] * len(claims)
    for pinned in (True, False):  # the unpinned pools reach their floor before a pinned one shrinks
        tier = sorted((i for i, c in enumerate(claims) if c.pinned == pinned), key=lambda i: extras[i])
        for n, i in enumerate(tier):  # max-min fair
            given[i] = min(extras[i], left // (len(tier) - n))
            left -= given[i]
    return [_within(c, pool_bytes(c.footprint, c.floor) + g) for c, g in zip(claims, given)]


def _within(claim: Claim, room: int) -> tuple[int, ...]:
    """The claim's slots capped at one count per layer, the largest cap whose pool fits `room`."""
    def capped(cap: int) -> tuple[int, ...]:
        return tuple(min(w, max(f, cap)) for w, f in zip(claim.wanted, claim.floor))

    low, high = 0, max(claim.wanted, default=0)  # capped(low) fits; find the largest cap that does
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if pool_bytes(claim.footprint, capped(middle)) <= room else (low, middle - 1)
    return capped(low)
