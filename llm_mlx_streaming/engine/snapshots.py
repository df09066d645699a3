"""Snapshots of a cache that cannot be rewound, so a later prompt resumes inside its prefix.

A growing attention cache can be cut back to any shorter prefix (engine/kv.rewinds), but
a linear-attention state, a sliding window that has wrapped and a chunked-attention cache
cannot: once fed, they hold only "after the last token". An agent's next prompt shares its
system prompt and tools with the last one and then differs (a new task, a re-rendered
reply whose reasoning the template dropped), so such a model would read the whole prompt
again. While a prompt is prefilled, the engine therefore copies its cache at chosen
positions: where the rendered prompt's stable parts end (the system prompt and tools; the
earlier turns, before the generation prompt) and every `every` tokens of a long stretch:
each layer's cache is copied as the tile that ends there reaches it, inside the one model
call of the prompt (engine/prefill.py), so a snapshot reads no expert again. A later
prompt resumes from the longest snapshot inside its common prefix and prefills only the
rest.

The snapshots are entries of the model's prompt cache (engine/prompt_cache.py, its
`take`), beside its conversations, bounded in count and bytes: those at the end of the
system prompt are typed "system", evicted last; those before the generation prompt
"user"; every-N ones "assistant", evicted first (mlx-lm's `LRUPromptCache` types).

A resumed prompt is cut into the same tiles as a cold one from that position on (the
snapshot positions are tile ends), so it computes exactly what a cold prefill computes.
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM, TURNS, INTERVAL = "system", "user", "assistant"  # LRUPromptCache's types, kept longest first


@dataclass(frozen=True)
class SnapshotSpec:
    """How often snapshots are taken, and how many and how many bytes are kept."""

    every: int  # a snapshot every this many prompt tokens (0: only at message boundaries)
    max_count: int
    max_bytes: int


@dataclass(frozen=True)
class Boundary:
    """A position in the rendered prompt where a stable part ends, and which part."""

    position: int
    kind: str  # SYSTEM or TURNS


def positions(start: int, end: int, boundaries, every: int) -> list[tuple[int, str]]:
    """(position, kind) of the snapshots to take while prefilling prompt tokens
    start..end: the boundaries and the multiples of `every` strictly inside, in order."""
    found = {b.position: b.kind for b in boundaries if start < b.position < end}
    if every:
        for p in range((start // every + 1) * every, end, every):
            found.setdefault(p, INTERVAL)
    return sorted(found.items())
