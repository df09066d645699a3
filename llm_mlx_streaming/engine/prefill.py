"""Long prompts: large prefill chunks for the experts, attention in tiles.

A prompt is prefilled in chunks of `prefill_step` tokens, and each MoE layer sees a
whole chunk in one call, so each expert the chunk routes to is read at most once per
chunk (experts/switch.py): the larger the chunk, the fewer bytes read per prompt token.
What makes a large chunk costly is attention: a chunk of T tokens against C cached keys
computes T x C scores (mlx materializes them on the CPU and for a quantized cache), and
a causal chunk computes its masked half too. So every full-attention layer takes a
chunk longer than `ATTENTION_TILE` tokens in tiles, in order, each tile against the
cache the earlier tiles filled: the attention work and memory of mlx-lm's default
2048-token chunks, the expert reads of one large chunk.

A tile is exactly the call mlx-lm makes for a chunk of that size: the same cache, the
same causal mask (the rows of the chunk's mask), so the tiles' outputs are the rows the
whole chunk's attention would give. Caches whose masks are not plain causal rows
(sliding windows) and non-causal calls are left whole.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .planner import ATTENTION_TILE  # mlx-lm's own default prefill chunk


class TiledAttention(nn.Module):
    """An mlx-lm attention module that takes long chunks in tiles."""

    def __init__(self, attention: nn.Module, tile: int = ATTENTION_TILE):
        super().__init__()
        self.attention = attention
        self.tile = tile

    def __getattr__(self, name):
        """Attributes the model reads off its attention module (a layer kind, a flag)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("attention"), name)

    def __call__(self, x: mx.array, *args, **kwargs):
        """mlx-lm's call, with the arguments exactly as given. Only the plain form
        (x, mask, cache) is tiled: a call given anything more (a KV shared from an
        earlier layer, a start position) is left whole, since what a tile of it would
        need is the module's own business."""
        given = {**dict(zip(("mask", "cache"), args)), **kwargs}
        mask, cache = given.get("mask"), given.get("cache")
        extra = [v for k, v in given.items() if k not in ("mask", "cache")] + list(args[2:])
        length = x.shape[1]
        if length <= self.tile or any(v is not None for v in extra) \
                or not _tileable(mask, cache, length):
            return self.attention(x, *args, **kwargs)
        offset = cache.offset
        outputs = []
        for start in range(0, length, self.tile):
            end = min(length, start + self.tile)
            rows = mask if isinstance(mask, str) else mask[..., start:end, : offset + end]
            if "mask" in kwargs:
                tile_args, tile_kwargs = args, {**kwargs, "mask": rows}
            else:
                tile_args, tile_kwargs = (rows, *args[1:]), kwargs
            outputs.append(self.attention(x[:, start:end], *tile_args, **tile_kwargs))
            mx.eval(outputs[-1])  # one tile's scores at a time, not every tile's at once
        return mx.concatenate(outputs, axis=1)


def _tileable(mask, cache, length: int) -> bool:
    """A causal call on a plain (or quantized) KV cache, whose mask rows can be cut."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if type(cache) not in (KVCache, QuantizedKVCache):
        return False
    if isinstance(mask, str):
        return mask == "causal"
    return isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == length \
        and mask.shape[-1] == cache.offset + length


def _plain_call(attention: nn.Module) -> bool:
    """Whether the module's call is mlx-lm's plain (x, mask, cache): the form whose
    tiles are known to be the rows of the whole call. Modules taking more (a shared KV,
    positions) may also return more than the output, and are left unwrapped."""
    import inspect

    params = list(inspect.signature(attention.__call__).parameters.values())
    return len(params) <= 3 and all(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
    )


def tile_attention(model: nn.Module, tile: int = ATTENTION_TILE) -> int:
    """Wrap every decoder layer's plain `self_attn` in a TiledAttention; the count wrapped."""
    count = 0
    for layer in getattr(model, "layers", []):
        attention = layer.get("self_attn") if isinstance(layer, nn.Module) else None
        if isinstance(attention, TiledAttention):
            attention.tile = tile
            count += 1
        elif isinstance(attention, nn.Module) and _plain_call(attention):
            layer.self_attn = TiledAttention(attention, tile)
            count += 1
    return count
