"""Eviction policies for the expert pool.

One policy object per MoE layer, made for that layer's slot count. The pool (and the
trace simulator) tell it about every access and every eviction, and ask it for a victim
among the resident experts that the current call does not need. Keys are computed from a
logical clock, so a policy behaves the same in the engine and in a replay of a routing
trace.
"""

from __future__ import annotations

from typing import Iterable


class Policy:
    """Base class: evicts the resident expert with the smallest `key`."""

    name = "base"

    def __init__(self, slots: int = 1) -> None:
        del slots  # only policies that scale with the pool use it
        self.clock = 0
        self.last_used: dict[int, int] = {}

    def record(self, expert: int) -> None:
        """One access to `expert` (a hit, or a load that made it resident)."""
        self.clock += 1
        self.last_used[expert] = self.clock

    def forget(self, expert: int) -> None:
        """`expert` left the pool."""
        self.last_used.pop(expert, None)

    def key(self, expert: int):
        raise NotImplementedError

    def victim(self, resident: Iterable[int], protected: set[int]) -> int:
        """The resident expert to evict; never one in `protected`."""
        best = None
        best_key = None
        for e in resident:
            if e in protected:
                continue
            k = self.key(e)
            if best_key is None or k < best_key:
                best, best_key = e, k
        if best is None:
            raise RuntimeError("every resident expert is protected: no slot to evict")
        return best


class LRU(Policy):
    """Least recently used."""

    name = "lru"

    def key(self, expert: int):
        return self.last_used.get(expert, 0)


class LFU(Policy):
    """Least frequently used while resident, least recently used among equals.

    The count starts at one when an expert is loaded and is dropped when it is evicted,
    so it measures popularity during the current stay only (compare `DecayedLFU`).
    """

    name = "lfu"

    def __init__(self, slots: int = 1) -> None:
        super().__init__(slots)
        self.count: dict[int, int] = {}

    def record(self, expert: int) -> None:
        super().record(expert)
        self.count[expert] = self.count.get(expert, 0) + 1

    def forget(self, expert: int) -> None:
        super().forget(expert)
        self.count.pop(expert, None)

    def key(self, expert: int):
        return (self.count.get(expert, 0), self.last_used.get(expert, 0))


class LFUDA(LFU):
    """LFU with dynamic aging: an expert's priority is its count plus the pool's age,
    the priority of the last victim, so experts that were popular long ago age out."""

    name = "lfuda"

    def __init__(self, slots: int = 1) -> None:
        super().__init__(slots)
        self.age = 0
        self.priority: dict[int, int] = {}

    def record(self, expert: int) -> None:
        super().record(expert)
        self.priority[expert] = self.count[expert] + self.age

    def forget(self, expert: int) -> None:
        self.age = self.priority.pop(expert, self.age)
        super().forget(expert)

    def key(self, expert: int):
        return (self.priority.get(expert, 0), self.last_used.get(expert, 0))


class DecayedLFU(Policy):
    """Most uses over the layer's whole history, in-pool or not, with old uses fading.

    Counts survive eviction (an expert the router keeps coming back to is worth keeping
    even after one unlucky eviction) and every count is halved each time the layer has
    seen `HALF_LIFE` accesses per slot, so a shift in what the router wants wins within a
    few pool turnovers. LRU breaks ties.
    """

    name = "decayed-lfu"
    HALF_LIFE = 16  # accesses per slot between halvings (docs/policies.md)

    def __init__(self, slots: int = 1) -> None:
        super().__init__(slots)
        self.count: dict[int, float] = {}
        self.period = self.HALF_LIFE * max(1, slots)

    def record(self, expert: int) -> None:
        super().record(expert)
        self.count[expert] = self.count.get(expert, 0) + 1
        if self.clock % self.period == 0:
            self.count = {e: c / 2 for e, c in self.count.items()}

    def key(self, expert: int):
        return (self.count.get(expert, 0), self.last_used.get(expert, 0))


POLICIES = {cls.name: cls for cls in (LRU, LFU, LFUDA, DecayedLFU)}

# What measured best on the real routing trace (docs/policies.md).
DEFAULT_POLICY = "decayed-lfu"


def make_policy(name: str, slots: int = 1) -> Policy:
    """A fresh policy by name for a layer of `slots` slots; a clear error for an unknown one."""
    try:
        return POLICIES[name](slots)
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}: choose one of {', '.join(sorted(POLICIES))}"
        ) from None
