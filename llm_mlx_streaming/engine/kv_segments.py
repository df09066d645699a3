"""A KV cache cut into the segments the conversation cache saves, and put back together.

A growing attention layer (mlx-lm's KVCache or QuantizedKVCache) is saved as the K/V of
its own token range and concatenated along the sequence axis on load; any other layer
(a sliding window, a linear-attention state) is bounded and saved whole. The checksum
covers what a segment holds, so a damaged file is known before it is used.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Optional


def checksum(cache) -> str:
    """sha256 over the caches' states in order: each array's name, dtype, shape and
    bytes, each scalar's name and value. The same on a saved cache and on the cache
    `load_prompt_cache` makes of its file, unless a byte of the file changed."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    digest = hashlib.sha256()
    for name, leaf in tree_flatten([c.state for c in cache]):
        if isinstance(leaf, mx.array):
            digest.update(f"{name}:{leaf.dtype}:{leaf.shape};".encode())
            digest.update(memoryview(mx.contiguous(leaf)))
        else:
            digest.update(f"{name}={leaf!r};".encode())
    return digest.hexdigest()


def layer_kind(layer) -> Optional[tuple]:
    """What a later segment may append to this layer: a growing attention cache's class
    (with its quantization); None for a state written in full (sliding window, linear
    attention, anything else)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if getattr(layer, "keys", None) is None:
        return None
    if type(layer) is KVCache:
        return ("KVCache",)
    if type(layer) is QuantizedKVCache:
        return ("QuantizedKVCache", layer.group_size, layer.bits)
    return None


def held_length(layer) -> int:
    """Positions a growing attention cache's arrays hold."""
    keys = layer.keys
    return (keys if not isinstance(keys, (list, tuple)) else keys[0]).shape[-2]


def segment_from(layer, start: int):
    """The layer's K/V from position `start` to its offset, as the same class."""
    from mlx.utils import tree_map

    part = copy.copy(layer)
    part.keys, part.values = tree_map(lambda a: a[..., start:layer.offset, :], (layer.keys, layer.values))
    return part


def assembled(parts: list[tuple[list, list]]) -> Optional[list]:
    """One cache from its segments' (cache, layer starts), first segment first: a
    layer's K/V concatenated along the sequence axis, a state written in full taken
    from the last segment; None where a segment does not fit the ones before."""
    import mlx.core as mx
    from mlx.utils import tree_map

    width = len(parts[0][0])
    layers, pieces = [None] * width, [[] for _ in range(width)]
    for cache, starts in parts:
        if len(cache) != width or len(starts) != width:
            return None
        for i, (layer, start) in enumerate(zip(cache, starts)):
            if start is None:  # written in full
                layers[i], pieces[i] = layer, []
                continue
            kind = layer_kind(layer)
            if kind is None or not isinstance(start, int) or held_length(layer) != layer.offset - start:
                return None
            if start == 0:
                pieces[i] = []
            elif layers[i] is None or layer_kind(layers[i]) != kind or layers[i].offset != start:
                return None
            layers[i] = layer
            pieces[i].append((layer.keys, layer.values))
    for layer, kv in zip(layers, pieces):
        if len(kv) > 1:
            layer.keys, layer.values = tree_map(lambda *xs: mx.concatenate(list(xs), axis=-2), *kv)
    return layers


def cut(cache, held: int, keep: int) -> Optional[list]:
    """`cache`, which holds `held` tokens, cut back to its first `keep`; None where it
    cannot be cut (engine/kv.rewinds: a linear-attention state is only ever extended)."""
    from mlx_lm.models.cache import trim_prompt_cache

    from .kv import rewinds

    if not rewinds(cache):
        return None
    trim_prompt_cache(cache, held - keep)
    return cache


def prefix(cache, keep: int) -> list:
    """A copy of the first `keep` tokens of a cache that can be cut back (engine/kv.rewinds),
    the cache left as it is: views of its K/V, which the copy's next write replaces
    (a cache that holds exactly its tokens grows into new arrays), so nothing is copied
    twice."""
    from mlx.utils import tree_map

    out = []
    for layer in cache:
        part = copy.copy(layer)
        if layer.keys is not None:
            part.keys, part.values = tree_map(lambda a: a[..., :keep, :], (layer.keys, layer.values))
        part.offset = keep
        out.append(part)
    return out
