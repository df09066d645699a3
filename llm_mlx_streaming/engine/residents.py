"""The models the engine holds, each a provider of its own; the running one is the engine.

The engine (engine/manager.py) is the provider of the model that runs; every other
loaded model waits as a ModelProvider of its own with its pools, its prompt cache and what
its generations carried (drafter, conversation cache). Turning to another one moves the
provider state across (`move`): nothing about a model is loaded again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from ..sizes import format_size
from .provider import ModelProvider
from .request import LoadSpec
from .respond import Carried
from . import sharing
from .sharing import Claim, least_bytes, pool_bytes, wanted_slots

# a provider's state that belongs to its model (the lock, the buffer cap and a rank's hook are the process's)
MOVED = ("state", "error", "loaded", "prompts", "expert_slots", "policy", "threads", "page_cache", "packed",
         "overlap", "_retired")


def move(source: ModelProvider, target: ModelProvider) -> None:
    """Hand `source`'s model to `target`, leaving `source` empty."""
    for name in MOVED:
        setattr(target, name, getattr(source, name))
    empty = ModelProvider()
    for name in MOVED:
        setattr(source, name, getattr(empty, name))


@dataclass
class Resident:
    """One loaded model: its provider (the engine itself while it runs) and its residency."""

    path: Path
    provider: ModelProvider
    carried: Carried
    spec: LoadSpec  # as last asked for: the slots it wants, its footprint
    used: float  # time.monotonic() of its last request
    pinned: bool = False  # named at the server's start: never unloaded to make room or for idleness
    slots: object = None  # the expert_slots it holds now (`spec.expert_slots` unless the budget shrank it)
    expires: Optional[float] = None  # time.time() it is unloaded at for idleness (None: never)

    def claim(self) -> Optional[Claim]:
        """Its share of a budget, None when it is not budgeted."""
        return sharing.claim_of(self.spec, self.pinned)

    def held_bytes(self) -> Optional[int]:
        """Bytes it holds by its footprint and the slots it has now (None: not budgeted)."""
        claim = self.claim()
        if claim is None:
            return None
        now = wanted_slots(claim.footprint, self.slots)
        return claim.footprint.fixed_bytes + pool_bytes(claim.footprint, now)

    def describe(self) -> str:
        held = self.held_bytes()
        return f"{self.path.name}" + (f" {format_size(held)}" if held is not None else "") + \
            (" pinned" if self.pinned else "")


def refusal(path: Path, spec: LoadSpec, budget: int, kept: list[Resident], max_models: int) -> str:
    """The one line a load that cannot fit is refused with: what it needs, what stays loaded."""
    claim = Resident(path, ModelProvider(), Carried(), spec, 0.0).claim()
    held = ", ".join(r.describe() for r in kept) or "nothing"
    if claim is None or len(kept) >= max_models:
        return f"cannot load {path.name}: max_models {max_models} are loaded and pinned ({held})"
    need = least_bytes([claim])
    return (f"cannot load {path.name}: it needs at least {format_size(need)} and the memory budget "
            f"{format_size(budget)} holds pinned {held}; unload one (keep_alive 0) or raise memory_budget")


class Residents:
    """The set of loaded models of one engine, under one memory budget: on the engine
    thread, under the engine's lock. A model that is not loaded joins the others when the
    split fits (engine/sharing.py), after the least recently used unpinned models are
    unloaded until it does; each leave gives the others' pools back their room."""

    def __init__(self) -> None:
        self.models: dict[Path, Resident] = {}
        self.max_models = 1  # `llm mlxs serve` raises it (max_models)
        self.pinned: set[Path] = set()
        self.loads = 0  # models loaded (a benchmark counts them)
        self.budget: Optional[int] = None  # the latest request's

    def admit(self, engine, spec: LoadSpec, now: float) -> Resident:
        """Make `spec`'s model the one `engine` runs, loading it beside the others if
        it is not loaded (LoadError, one line, when it cannot fit)."""
        from .provider import LoadError

        path = Path(spec.path).expanduser().resolve()
        self.budget = spec.budget if spec.budget is not None else self.budget
        found = self.models.get(path)
        if found is None:
            slots = self._make_room(engine, path, spec)
            self._park(engine)
            engine.load_spec(_with_slots(spec, slots))  # a LoadError leaves the others as they were
            found = self.models[path] = Resident(path, engine, engine.carried, spec, now,
                                                 pinned=path in self.pinned, slots=slots)
            self.loads += 1
        else:
            if found.provider is not engine:
                self._park(engine)
                move(found.provider, engine)
                found.provider, engine.carried = engine, found.carried
            try:
                if spec != found.spec:
                    found.spec = spec
                    self._share(engine)
                engine.load_spec(_with_slots(spec, found.slots))
            except LoadError:
                self.models.pop(path, None)
                raise
            self.models.setdefault(path, found)
        found.used = now
        return found

    def release(self, engine, path: Path) -> bool:
        """Unload the model at `path` (False when it is not loaded); the others grow back."""
        found = self.models.get(Path(path).expanduser().resolve())
        if found is None:
            return False
        self._drop(engine, found)
        self._share(engine)
        return True

    def unload_all(self, engine) -> None:
        for resident in list(self.models.values()):
            if resident.provider is not engine:
                resident.provider.unload()
        self.models.clear()

    def running(self, engine) -> Optional[Resident]:
        return next((r for r in self.models.values() if r.provider is engine), None)

    def _park(self, engine) -> None:
        """The model `engine` runs waits as a provider of its own."""
        current = self.running(engine)
        if current is None:
            return
        current.provider = ModelProvider()
        move(engine, current.provider)
        current.carried, engine.carried = engine.carried, Carried(warned=engine.carried.warned)

    def _drop(self, engine, resident: Resident) -> None:
        del self.models[resident.path]
        if resident.provider is engine:
            engine.drop_running()
        else:
            resident.provider.unload()

    def _make_room(self, engine, path: Path, spec: LoadSpec):
        """Unload least recently used unpinned models until `spec`'s fits beside the
        rest, shrink the others' pools to their share, and return its own."""
        from .provider import LoadError

        new = Resident(path, ModelProvider(), Carried(), spec, 0.0, pinned=path in self.pinned,
                       slots=spec.expert_slots)
        while True:
            others = list(self.models.values())
            shares = self._shares([*others, new]) if len(others) < self.max_models else None
            if shares is not None:
                self._apply(engine, list(zip(others, shares)))
                return shares[-1]
            victims = sorted((r for r in others if not r.pinned), key=lambda r: r.used)
            if not victims:
                raise LoadError(refusal(path, spec, self.budget or 0, others, self.max_models))
            self._drop(engine, victims[0])

    def _shares(self, residents: list[Resident]) -> Optional[list]:
        """The expert_slots of each model under the budget (a model alone, or one not
        budgeted: what it asked for); None when their floors do not fit together."""
        budgeted = [r.claim() is not None for r in residents]
        if sum(budgeted) < 2 or self.budget is None:
            return [r.spec.expert_slots for r in residents]
        split = iter(sharing.split(self.budget, [r.claim() for r, b in zip(residents, budgeted) if b]) or ())
        shares = []
        for resident, counted in zip(residents, budgeted):
            slots = next(split, None) if counted else resident.spec.expert_slots
            if counted and slots is None:
                return None
            shares.append(resident.spec.expert_slots if not counted or slots == resident.claim().wanted
                          else list(slots))
        return shares

    def _share(self, engine) -> None:
        """Give every model its share of the budget as it stands (after a load, a
        leave, a model asking for other slots)."""
        residents = list(self.models.values())
        shares = self._shares(residents)
        if shares is not None:  # the floors fitted when the last one loaded
            self._apply(engine, list(zip(residents, shares)))

    @staticmethod
    def _apply(engine, pairs: list) -> None:
        """Rebuild the pools whose slot count changes, the shrinking ones first, so the
        pools never hold more than the budget between two; dense weights and KV stay.
        The running model's go through the engine's own load (its spec with the new
        slots): a pipeline's engine turns a one-machine slot list into each rank's plan
        and has every rank rebuild its own layers' pools, where `configure` would give
        rank 0's provider the whole model's list."""
        def growth(pair) -> int:
            resident, slots = pair
            if resident.spec.footprint is None:
                return 0
            return sum(wanted_slots(resident.spec.footprint, slots)) - sum(
                wanted_slots(resident.spec.footprint, resident.slots))

        for resident, slots in sorted(pairs, key=growth):
            if slots != resident.slots:
                if resident.provider is engine:
                    engine.load_spec(_with_slots(resident.spec, slots))
                else:
                    resident.provider.configure(expert_slots=slots)
                resident.slots = slots


def _with_slots(spec: LoadSpec, slots) -> LoadSpec:
    return spec if slots == spec.expert_slots else replace(spec, expert_slots=slots)
