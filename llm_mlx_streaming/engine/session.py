"""The KV cache kept between generations, and how much of it a new prompt can reuse.

A chat turn's prompt is the previous turn's prompt and reply plus the new message, so
its tokens usually extend what the cache already holds: only the new tokens need a
prefill. Caches that can be trimmed (attention KV, quantized or not) are cut back to
the common prefix (a chunked-attention cache only to a chunk it still holds whole); those that cannot (linear-attention state) are reused only when the
cached tokens are a strict prefix of the new prompt: such a state cannot be rewound,
only extended. A cache is reused only under the KV layout it was built with (see
engine/kv.py): a turn that asks for another one starts a new cache.

Two different images can be the same placeholder tokens, so a cache also remembers the
images it has seen (their digests, in order): it is reused only when those are the new
prompt's first images or the new prompt's images are its first ones; otherwise equal
tokens would stand for another picture, and it starts over.
"""

from __future__ import annotations

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


class Session:
    def __init__(self, model):
        self.model = model
        self.cache = None
        self.tokens: list[int] = []  # exactly the tokens the cache has seen
        self.kv: KVSpec = FULL_PRECISION  # the layout the cache was made for
        self.images: tuple[str, ...] = ()  # digests of the images the cache has seen, in order

    def reset(self) -> None:
        self.cache = None
        self.tokens = []
        self.images = ()

    def reuse_for(self, prompt: list[int], kv: KVSpec = FULL_PRECISION,
                  images: tuple[str, ...] = ()) -> tuple[list, list[int], int]:
        """(cache, tokens still to prefill, tokens reused) for `prompt` (showing `images`,
        their digests in order) under layout `kv`."""
        shared = min(len(images), len(self.images))
        if kv != self.kv or images[:shared] != self.images[:shared]:
            self.reset()
        self.images = tuple(images)  # what the cache holds once this prompt is fed
        reuse = 0
        if self.cache is not None:
            reuse = min(common_prefix_len(self.tokens, prompt), len(prompt) - 1)
            if reuse < len(self.tokens):
                if reuse > 0 and can_rewind(self.cache, reuse):
                    trim_prompt_cache(self.cache, len(self.tokens) - reuse)
                else:
                    reuse = 0
        if reuse == 0:
            self.cache = make_cache(self.model, kv)
            self.kv = kv
        self.tokens = list(prompt[:reuse])
        return self.cache, list(prompt[reuse:]), reuse

    def fed(self, tokens) -> None:
        """Record tokens that went through the model into the cache."""
        self.tokens.extend(int(t) for t in tokens)

    # -- a cache loaded from the conversation cache on disk ------
    def adopt(self, cache, tokens: list[int], kv: KVSpec) -> None:
        """Use `cache`, which has seen exactly `tokens` under layout `kv`."""
        self.cache, self.tokens, self.kv, self.images = cache, list(tokens), kv, ()
