"""What a drafter is, and how a name given with ``-o draft NAME`` becomes one.

A drafter guesses the next few tokens cheaply; the engine checks them with one
forward pass of the target over ``[last, d1..dk]`` and keeps the longest prefix the
target agrees with. Drafters never decide what is emitted, so a bad drafter costs
speed, never correctness.

Drafter kinds register a factory under a name (``register``). ``make_drafter`` looks a
name up there first ("ngram", "mtp"), then among the models added with
``llm mlxs add`` (a draft model, speculation/draft_model.py). Scripted drafters for
tests and benchmarks (speculation/scripted.py) are built directly, never by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, runtime_checkable


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens continuing the sequence it has been shown.

    needs_hidden: True when ``accept`` wants the target's final hidden states (an MTP
    head drafts from them); the engine computes them only then.
    """

    name: str
    needs_hidden: bool

    def reset(self, tokens: list[int]) -> None:
        """Start of a generation: the whole sequence so far (prompt, reused prefix included)."""

    def propose(self, k: int) -> list[int]:
        """Up to k draft token ids continuing the sequence (fewer, or none, is fine)."""

    def accept(self, tokens: list[int], hidden: Any) -> None:
        """Tokens appended to the sequence after a verify pass.

        `tokens` are the accepted drafts plus the verifier's own token. `hidden` is an
        mx.array (len(tokens), hidden_size): the target's final hidden states (after its
        final norm, i.e. the output of ``model.model(...)``) at the positions that
        produced those tokens; None when ``needs_hidden`` is False.
        """


@dataclass
class DraftContext:
    """What a drafter factory may build from: the target as the engine loaded it.

    model: the mlx-lm model the engine runs (its MoE layers stream experts);
    loaded: the engine's StreamingModel (store, pools, config) or None in tests
    that drive a plain mlx-lm model; checkpoint: the target's checkpoint directory;
    settings: the plugin's Settings (None: defaults); resolve: maps a registered model
    name to its checkpoint directory (None when no registry is at hand).
    """

    model: Any
    tokenizer: Any
    checkpoint: Optional[Path] = None
    loaded: Any = None
    settings: Any = None
    resolve: Optional[Callable[[str], Optional[Path]]] = None


DrafterFactory = Callable[[DraftContext], Drafter]
FACTORIES: dict[str, DrafterFactory] = {}


class DraftError(ValueError):
    """A drafter that cannot be built for this target (unknown name, other vocabulary...)."""


def register(name: str):
    """Decorator: make `factory(context) -> Drafter` available as ``-o draft NAME``."""

    def add(factory: DrafterFactory) -> DrafterFactory:
        FACTORIES[name] = factory
        return factory

    return add


def make_drafter(name: str, context: DraftContext) -> Drafter:
    """The drafter called `name` for the target in `context`; DraftError in one line if none."""
    _load_builtin_kinds()
    factory = FACTORIES.get(name)
    if factory is not None:
        return factory(context)
    path = context.resolve(name) if context.resolve else None
    if path is None:
        known = ", ".join(sorted(FACTORIES)) or "none"
        raise DraftError(
            f"unknown draft {name!r}: use one of {known}, or a model added with `llm mlxs add`"
        )
    from .draft_model import build_draft_model

    return build_draft_model(context, name, path)


def builtin_kinds() -> set[str]:
    """The drafter names that need no added model ("ngram", "mtp", ...)."""
    _load_builtin_kinds()
    return set(FACTORIES)


def _load_builtin_kinds() -> None:
    """Import the modules that register drafter kinds (absent ones are skipped)."""
    import importlib

    for module in ("ngram", "mtp"):
        try:
            importlib.import_module(f"{__package__}.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{module}":
                raise
