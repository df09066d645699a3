"""The models one engine holds under one memory budget, and the one that runs.

Each loaded model is one ModelProvider for its whole life (engine/provider.py); the
engine runs one of them by reference, so turning to another moves nothing. A model that
is not loaded joins the others when the split fits (engine/sharing.py), after the least
recently used unpinned models are unloaded until it does; each leave gives the others'
pools back their room. The limits (how many models, which are pinned, the budget) are
the process's, set through the engine (a server sets them at its start); other threads
read what is loaded as immutable records (`Residency`), published at each change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from ..errors import one_line
from ..sizes import format_size
from . import sharing
from .provider import LoadError, ModelProvider
from .request import LoadSpec


@dataclass(frozen=True)
class Limits:
    """The process's residency: how many models stay loaded at once, which are pinned
    (never unloaded to make room; they shrink last), and the bytes they share."""

    max_models: int = 1
    pinned: frozenset = frozenset()  # checkpoint paths, resolved
    budget: Optional[int] = None  # None: each model gets the slots it asks for


@dataclass(frozen=True)
class ModelRecord:
    """One loaded model as other threads see it."""

    path: Path
    expert_slots: object  # the slots it holds now (its share when the budget shrank it)
    memory_bytes: Optional[int]  # its share of the budget (None: not budgeted)
    pinned: bool
    running: bool
    dense_bytes: int  # what it holds beside its pools
    experts_bytes: int  # its pools
    slots: int  # over every pool
    kv_bytes: int  # its prompt cache's conversations and snapshots, as its last generation left them
    counters: dict = field(default_factory=dict)  # its pools' counters since its load, when read


@dataclass(frozen=True)
class Residency:
    """What an engine holds: its loaded models, its limits, the loads since its start,
    and how its latest load went (empty | loading | loaded | error, with the error)."""

    models: tuple[ModelRecord, ...] = ()
    limits: Limits = Limits()
    loads: int = 0
    state: str = "empty"
    error: Optional[str] = None


def refusal(path: Path, spec: LoadSpec, held: list[ModelProvider], limits: Limits) -> str:
    """The one line a load that cannot fit is refused with: what it needs, what stays loaded."""
    claim = sharing.claim_of(spec)
    kept = ", ".join(_describe(m, limits) for m in held) or "nothing"
    if claim is None or len(held) >= limits.max_models:
        return f"cannot load {path.name}: max_models {limits.max_models} are loaded and pinned ({kept})"
    return (f"cannot load {path.name}: it needs at least {format_size(sharing.least_bytes([claim]))} and the "
            f"memory budget {format_size(limits.budget or 0)} holds pinned {kept}; unload one (keep_alive 0) "
            "or raise memory_budget")


def _describe(model: ModelProvider, limits: Limits) -> str:
    held = model.held_bytes()
    return f"{model.checkpoint.name}" + (f" {format_size(held)}" if held is not None else "") + \
        (" pinned" if model.checkpoint in limits.pinned else "")


class Residents:
    """The loaded models of one engine and the one that runs: on the engine thread,
    under the engine's lock (`shown` is what other threads read)."""

    def __init__(self) -> None:
        self.models: dict[Path, ModelProvider] = {}
        self.running: Optional[ModelProvider] = None
        self.limits = Limits()
        self.loads = 0  # models loaded (a benchmark counts them)
        self.loading: Optional[Path] = None
        self.failure: Optional[str] = None  # why the latest load failed
        self.shown = Residency()

    def turn_to(self, spec: LoadSpec, now: float, make: Callable[[], ModelProvider]) -> ModelProvider:
        """Run `spec`'s model: the loaded one, another one loaded (kept as it was), or one
        `make()` loads beside them within the budget (LoadError, one line, when it cannot fit)."""
        path = Path(spec.path).expanduser().resolve()
        found = self.models.get(path)
        self.running, self.failure = None, None
        try:
            if found is None:
                found = self._load(path, spec, make)
            else:
                if spec != found.spec:
                    found.spec = spec
                    self._share()  # its share as asked now (pools rebuilt only where a share changed)
                self._reload(found, spec, found.expert_slots)
        except BaseException:
            self.publish()
            raise
        found.used, self.running = now, found
        self.publish()
        return found

    def _load(self, path: Path, spec: LoadSpec, make: Callable[[], ModelProvider]) -> ModelProvider:
        slots = self._make_room(path, spec)
        model = make()
        model.spec, self.loading = spec, path
        self.publish()
        try:
            self._reload(model, spec, slots)
        finally:
            self.loading = None
        self.models[path] = model
        self.loads += 1
        return model

    def _reload(self, model: ModelProvider, spec: LoadSpec, slots) -> None:
        """`model` loaded (or its pools rebuilt) as `spec` asks, with `slots`; one that fails leaves."""
        try:
            model.load_spec(_with_slots(spec, slots))
        except BaseException as e:
            self.failure = model.error or one_line(e)
            if model in self.models.values():
                self._drop(model)
            model.unload()
            raise

    def unload(self, path: Optional[Path] = None) -> bool:
        """Unload the model at `path` (None: every model); the others grow back. False
        when it is not loaded."""
        if path is None:
            for model in list(self.models.values()):
                self._drop(model)
            self.publish()
            return True
        found = self.models.get(Path(path).expanduser().resolve())
        if found is not None:
            self._drop(found)
            self._share()
        self.publish()
        return found is not None

    def limit(self, limits: Limits) -> None:
        """Set the process's limits; the loaded models get their shares under them."""
        self.limits = limits
        self._share()
        self.publish()

    def pinned(self, model: ModelProvider) -> bool:
        return model.checkpoint in self.limits.pinned

    def publish(self) -> None:
        """The records other threads read, as things stand now."""
        models = []
        for path, model in self.models.items():
            dense, experts, slots = model.memory_parts()
            models.append(ModelRecord(path, model.expert_slots, model.held_bytes(), self.pinned(model),
                                      model is self.running, dense, experts, slots,
                                      model.prompts.held_bytes if model.prompts is not None else 0))
        state = "loading" if self.loading else "loaded" if self.running else "error" if self.failure else "empty"
        self.shown = Residency(tuple(models), self.limits, self.loads, state, self.failure)

    def _drop(self, model: ModelProvider) -> None:
        self.models = {path: m for path, m in self.models.items() if m is not model}
        if model is self.running:
            self.running = None
        model.unload()

    def _make_room(self, path: Path, spec: LoadSpec):
        """Unload least recently used unpinned models until `spec`'s fits beside the
        rest, shrink the others' pools to their share, and return its own."""
        while True:
            others = list(self.models.values())
            asks = [(m.spec, self.pinned(m)) for m in others] + [(spec, path in self.limits.pinned)]
            shares = self._shares(asks) if len(others) < self.limits.max_models else None
            if shares is not None:
                self._apply(list(zip(others, shares)))
                return shares[-1]
            victims = sorted((m for m in others if not self.pinned(m)), key=lambda m: m.used)
            if not victims:
                raise LoadError(refusal(path, spec, others, self.limits))
            self._drop(victims[0])

    def _shares(self, asks: list[tuple[LoadSpec, bool]]) -> Optional[list]:
        """The expert_slots of each (spec, pinned) under the budget (a model alone, or
        one not budgeted: what it asked for); None when their floors do not fit together."""
        claims = [sharing.claim_of(spec, pinned) for spec, pinned in asks]
        if sum(c is not None for c in claims) < 2 or self.limits.budget is None:
            return [spec.expert_slots for spec, _ in asks]
        split = iter(sharing.split(self.limits.budget, [c for c in claims if c is not None]) or ())
        shares = []
        for (spec, _), claim in zip(asks, claims):
            slots = next(split, None) if claim is not None else spec.expert_slots
            if claim is not None and slots is None:
                return None
            shares.append(spec.expert_slots if claim is None or slots == claim.wanted else list(slots))
        return shares

    def _share(self) -> None:
        """Give every model its share of the budget as it stands (after a load, a
        leave, a model asking for other slots, new limits)."""
        models = list(self.models.values())
        shares = self._shares([(m.spec, self.pinned(m)) for m in models])
        if shares is not None:  # the floors fitted when the last one loaded
            self._apply(list(zip(models, shares)))

    @staticmethod
    def _apply(pairs: list) -> None:
        """Rebuild the pools whose slot count changes, the shrinking ones first, so the
        pools never hold more than the budget between two; dense weights and KV stay.
        Each goes through its stepping's load (its spec with the new slots): a
        pipeline's turns a one-machine slot list into each rank's plan and has every
        rank rebuild its own layers' pools."""
        def growth(pair) -> int:
            model, slots = pair
            footprint = model.spec.footprint
            if footprint is None:
                return 0
            return sum(sharing.wanted_slots(footprint, slots)) - sum(sharing.wanted_slots(footprint, model.expert_slots))

        for model, slots in sorted(pairs, key=growth):
            if slots != model.expert_slots:
                model.load_spec(_with_slots(model.spec, slots))


def _with_slots(spec: LoadSpec, slots) -> LoadSpec:
    return spec if slots == spec.expert_slots else replace(spec, expert_slots=slots)
