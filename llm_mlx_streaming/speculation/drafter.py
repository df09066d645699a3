"""What a drafter is, and what one is built from.

A drafter guesses the next few tokens cheaply; the engine checks them with one
forward pass of the target over ``[last, d1..dk]`` and keeps the longest prefix the
target agrees with. Drafters never decide what is emitted, so a bad drafter costs
speed, never correctness.

speculation/kinds.py turns a name given with ``-o draft NAME`` into one. Scripted
drafters for tests and benchmarks (fixtures/scripted.py, not installed) are built directly.
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
    draft_path: maps a registered model name to its checkpoint directory (None when
    no registry is at hand).
    """

    model: Any
    tokenizer: Any
    checkpoint: Optional[Path] = None
    loaded: Any = None
    draft_path: Optional[Callable[[str], Optional[Path]]] = None


class DraftError(ValueError):
    """A drafter that cannot be built for this target (unknown name, other vocabulary...)."""
