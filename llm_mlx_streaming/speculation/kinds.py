"""How a name given with ``-o draft NAME`` becomes a drafter.

A name is one of the built-in kinds first ("ngram", "mtp"), then a model added with
``llm mlxs add`` (a draft model, speculation/draft_model.py).
"""

from __future__ import annotations

from . import draft_model, mtp, ngram
from .drafter import DraftContext, Drafter, DraftError

KINDS = {"ngram": ngram.build, "mtp": mtp.build}


def make_drafter(name: str, context: DraftContext) -> Drafter:
    """The drafter called `name` for the target in `context`; DraftError in one line if none."""
    if name in KINDS:
        return KINDS[name](context)
    path = context.draft_path(name) if context.draft_path else None
    if path is None:
        raise DraftError(
            f"unknown draft {name!r}: use one of {', '.join(sorted(KINDS))}, or a model added with `llm mlxs add`"
        )
    return draft_model.build_draft_model(context, name, path)


def builtin_kinds() -> set[str]:
    """The drafter names that need no added model."""
    return set(KINDS)
