"""The KV cache kept between generations, and how much of it a new prompt can reuse.

A chat turn's prompt is the previous turn's prompt and reply plus the new message, so
its tokens usually extend what the cache already holds: only the new tokens need a
prefill. Caches that can be trimmed (attention KV, quantized or not) are cut back to
the common prefix (a chunked-attention cache only to a chunk it still holds whole); those
that cannot (linear-attention state, a wrapped sliding window) are extended when the
cached tokens are a strict prefix of the new prompt, and otherwise resume from the
longest snapshot inside the common prefix (engine/snapshots.py). A cache is reused only
under the KV layout it was built with (see engine/kv.py): a turn that asks for another
one starts a new cache.

Each reuse says where its tokens came from ("memory": this cache; "snapshot") and, when
it reuses less than the prompt shares with the last conversation, why (`Reuse.note`).

Two different images can be the same placeholder tokens, so a cache also remembers the
images it has seen (their digests, in order): it is reused only when those are the new
prompt's first images or the new prompt's images are its first ones; otherwise equal
tokens would stand for another picture, and it starts over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.utils import common_prefix_len

from .kv import FULL_PRECISION, KVSpec, make_cache


def can_rewind(cache: list, tokens: int) -> bool:
    """Whether trimming `cache` back to its first `tokens` tokens leaves exactly the cache
    those tokens built. mlx-lm's `ChunkedKVCache` (llama4) says it is always trimmable,
    but it drops keys before the current attention chunk: it can be cut back only to a
    position whose chunk it still holds from the chunk's first token."""
    for layer in cache:
        start, chunk = getattr(layer, "start_position", 0), getattr(layer, "chunk_size", None)
        if start and chunk and start > tokens // chunk * chunk:
            return False
    return can_trim_prompt_cache(cache)


@dataclass
class Reuse:
    """Where a prompt's reused tokens came from, and why not more."""

    source: Optional[str] = None  # "memory", "snapshot" or "disk"; None: nothing reused
    note: Optional[str] = None  # why less than the prompt's prefix shared with the last conversation


class Session:
    def __init__(self, model):
        from .snapshots import cache_rewinds

        self.model = model
        self.rewinds = cache_rewinds(make_cache(model, FULL_PRECISION))
        self.snapshots = None  # engine/snapshots.Snapshots, for caches that cannot be rewound
        self.cache = None
        self.tokens: list[int] = []  # exactly the tokens the cache has seen
        self.kv: KVSpec = FULL_PRECISION  # the layout the cache was made for
        self.images: tuple[str, ...] = ()  # digests of the images the cache has seen, in order
        self.last = Reuse()  # what the latest `reuse_for` found

    def keep_snapshots(self, spec) -> None:
        """Take and use snapshots as `spec` (a SnapshotSpec; None: none) says, when this
        model's cache cannot be rewound; a new spec starts an empty store."""
        from .snapshots import Snapshots

        if spec is None or self.rewinds:
            self.snapshots = None
        elif self.snapshots is None or self.snapshots.spec != spec:
            self.snapshots = Snapshots(spec)

    def reset(self) -> None:
        self.cache = None
        self.tokens = []
        self.images = ()

    def reuse_for(self, prompt: list[int], kv: KVSpec = FULL_PRECISION,
                  images: tuple[str, ...] = ()) -> tuple[list, list[int], int]:
        """(cache, tokens still to prefill, tokens reused) for `prompt` (showing `images`,
        their digests in order) under layout `kv`."""
        shared = min(len(images), len(self.images))
        note = None
        if self.cache is not None and (kv != self.kv or images[:shared] != self.images[:shared]):
            note = "another KV layout" if kv != self.kv else "other images"
            self.reset()
        self.images = tuple(images)  # what the cache holds once this prompt is fed
        held = len(self.tokens) if self.cache is not None else 0
        common = min(common_prefix_len(self.tokens, prompt), len(prompt) - 1) if held else 0
        reuse = common
        if 0 < reuse < len(self.tokens) and not can_rewind(self.cache, reuse):
            reuse = 0
        found = None
        if self.snapshots is not None and not images:
            found = self.snapshots.nearest(kv, prompt, reuse)
        if found is not None:
            self.cache, reuse = found
            self.kv, source = kv, "snapshot"
        elif reuse:
            if reuse < len(self.tokens):
                trim_prompt_cache(self.cache, len(self.tokens) - reuse)
            source = "memory"
        else:
            self.cache, self.kv, source = make_cache(self.model, kv), kv, None
        if note is None and reuse < common:
            note = f"no snapshot inside the {common} tokens shared"
        elif note is None and reuse == common < held and common < len(prompt) - 1:
            note = f"diverged at token {common}"
        self.last = Reuse(source, note)
        self.tokens = list(prompt[:reuse])
        return self.cache, list(prompt[reuse:]), reuse

    def fed(self, tokens) -> None:
        """Record tokens that went through the model into the cache."""
        self.tokens.extend(int(t) for t in tokens)

    # -- a cache loaded from the conversation cache on disk ------
    def adopt(self, cache, tokens: list[int], kv: KVSpec) -> None:
        """Use `cache`, which has seen exactly `tokens` under layout `kv`."""
        self.cache, self.tokens, self.kv, self.images = cache, list(tokens), kv, ()
