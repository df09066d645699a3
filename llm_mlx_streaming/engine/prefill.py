"""A cold prompt reads each expert once: one large model call, every mixer in tiles.

On a streamed model a prefill is paid in expert reads, and each MoE layer reads every
expert a model call routes to once per call (experts/switch.py). So the engine feeds a
prompt in *expert chunks* as large as memory allows (engine/planner.py `expert_chunk`:
an agent's whole prompt on a Mac-sized budget), not in mlx-lm's 2048-token chunks.

Only the MoE layers see the whole chunk. Every decoder layer's token mixer (attention,
a sliding window, linear attention, a state-space layer: each child of a decoder layer
that takes the layer's `cache`) is wrapped in a `TiledMixer`, which takes a long call in
tiles, in order, each against the cache the earlier tiles filled, with the mask the
model would have built for a call of that tile (asked of the cache, as mlx-lm's models
ask it). The tiles are where mlx-lm's own prefill would end its chunks, so each mixer
computes exactly what stock mlx-lm computes, and holds one tile's scores and states.

A tile also ends where a snapshot of the cache is kept (engine/snapshots.py): the layer's
cache is copied as its tile reaches the position, so a snapshot reads no expert again.
And after each tile a KV cache switches to its quantized form where mlx-lm's
`generate_step` would switch it after a chunk (kv_bits).

The memory this keeps bounded: a layer holds the chunk's hidden states and its expert
routes' outputs (experts/switch.py computes one group of experts at a time); attention
scores are one tile's. What cannot be tiled (a cache kept by chunks of positions, a
mixer taking more than mlx-lm's plain `(x, mask, cache)`) keeps the model at
mlx-lm's 2048-token chunks, with the reason in `Tiling.limit`.
"""

from __future__ import annotations

import copy
import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .. import syncs
from ..activity import ACTIVITY
from ..experts import switch
from .footprint import ATTENTION_TILE  # mlx-lm's own default prefill chunk

VERIFIED_MASK = 1 << 26  # an array mask up to this many entries is checked against the one rebuilt per tile


@dataclass
class Pass:
    """What one model call of a prefill asks of the tiled mixers."""

    start: int  # absolute position of the call's first token
    ends: tuple[int, ...]  # absolute positions where the call's tiles end, the last its end
    marks: frozenset = frozenset()  # of those, where each layer's cache is copied (a snapshot)
    quantize: dict = field(default_factory=dict)  # mlx-lm's kv_bits, kv_group_size, quantized_kv_start
    between: Optional[Callable[[], None]] = None  # after each tile and expert group (it may raise to stop)
    captured: dict = field(default_factory=dict)  # mark -> {id(layer cache as given): copy}
    replaced: dict = field(default_factory=dict)  # id(layer cache as given) -> its quantized successor
    seen: set = field(default_factory=set)  # id of each layer cache a tiled mixer took
    untiled: int = 0  # long calls a mixer had to take whole


_local = threading.local()


def current() -> Optional[Pass]:
    return getattr(_local, "current", None)


@contextmanager
def running(p: Optional[Pass]):
    """Make `p` the pass the tiled mixers follow on this thread; the expert groups call its
    `between` too. None suspends the pass under way (a decode pass run inside it)."""
    outer = current()
    _local.current = p
    try:
        with switch.between_groups(p.between if p is not None else None):
            yield p
    finally:
        _local.current = outer


@contextmanager
def suspended():
    """Run something else (another request's decode step) inside a prefill's call."""
    with running(None):
        yield


class TiledMixer(nn.Module):
    """An mlx-lm token mixer (attention, a recurrent layer) that takes long calls in tiles."""

    def __init__(self, mixer: nn.Module, tile: int = ATTENTION_TILE):
        super().__init__()
        self.mixer = mixer
        self.tile = tile
        # the names its call takes after x, in order: (mask, cache) or (cache)
        self.names = tuple(inspect.signature(mixer.__call__).parameters)[1:]

    def __getattr__(self, name):
        """Attributes the model reads off its mixer (a layer kind, a flag)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("mixer"), name)

    def __call__(self, x: mx.array, *args, **kwargs):
        """mlx-lm's call, with the arguments exactly as given. Only the plain form
        (x, mask, cache) is tiled; a call given anything more is the module's own."""
        given = {**dict(zip(self.names, args)), **kwargs}
        mask, cache = given.get("mask"), given.get("cache")
        extra = [v for k, v in given.items() if k not in ("mask", "cache")]
        p = current()
        if p is not None and cache is not None:
            p.seen.add(id(cache))
        length = x.shape[1]
        ends = _tile_ends(p, length, self.tile)
        if len(ends) == 1 and not (p and p.marks and p.start + length in p.marks):
            return self.mixer(x, *args, **kwargs)
        masks = None if any(v is not None for v in extra) else _masks(mask, cache, length)
        if masks is None:
            if p is not None:
                p.untiled += 1
            return self.mixer(x, *args, **kwargs)
        key, outputs, begin = id(cache), [], 0
        for end in ends:
            tile_args, tile_kwargs = _substituted(self.names, args, kwargs, masks(cache, end - begin), cache)
            outputs.append(self.mixer(x[:, begin:end], *tile_args, **tile_kwargs))
            syncs.evaluate(outputs[-1])  # one tile's scores and states at a time
            if p is not None:
                ACTIVITY.mixed(end / length)  # the dashboard's progress through a long call
                cache = _after_tile(p, key, cache, p.start + end)
            begin = end
        return mx.concatenate(outputs, axis=1)


def _substituted(names, args, kwargs, mask, cache):
    """The call's arguments with the tile's mask and the layer's cache as it stands."""
    args, kwargs = list(args), dict(kwargs)
    for name, value in (("mask", mask), ("cache", cache)):
        if name in kwargs:
            kwargs[name] = value
        elif name in names and names.index(name) < len(args):
            args[names.index(name)] = value
    return args, kwargs


def _tile_ends(p: Optional[Pass], length: int, tile: int) -> list[int]:
    """Where this call's tiles end, relative to its start."""
    if p is None:
        return [min(length, s + tile) for s in range(0, length, tile)]
    ends = [e - p.start for e in p.ends if p.start < e <= p.start + length]
    if not ends or ends[-1] != length:  # a call of another length than the pass planned (a nested one)
        return [min(length, s + tile) for s in range(0, length, tile)]
    return ends


def _after_tile(p: Pass, key: int, cache, position: int):
    """A KV cache's switch to its quantized form where generate_step makes it; a copy of
    the layer's cache where a snapshot is kept; the pass's `between`."""
    q = p.quantize
    if q and hasattr(cache, "to_quantized") and cache.offset >= q["quantized_kv_start"]:
        cache = cache.to_quantized(group_size=q["kv_group_size"], bits=q["kv_bits"])
        p.replaced[key] = cache
    if position in p.marks:
        kept = copy.deepcopy(cache)
        syncs.evaluate([kept.state])
        p.captured.setdefault(position, {})[key] = kept
    if p.between is not None:
        p.between()
    return cache


# -- masks per tile ----------------------------------------------------------------------


def _masks(mask, cache, length: int):
    """A function (cache, n) -> the mask the model builds for an n-token call on `cache`
    as it stands, or None when this call's mask cannot be rebuilt tile by tile."""
    from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

    if isinstance(cache, ArraysCache):
        # recurrent state: a single sequence's call has no mask (create_ssm_mask: None)
        return (lambda c, n: None) if mask is None else None
    source = _mask_source(cache)
    if source is None or mask is None:
        return None
    rotating = isinstance(source, RotatingKVCache)
    if not rotating and not isinstance(source, (KVCache, QuantizedKVCache)):
        return None
    window = source.max_size if rotating else None
    if isinstance(mask, str):
        if mask != "causal":
            return None
        array = False
    elif isinstance(mask, mx.array):
        # Arrays were asked for when the cache would have said "causal" for this call
        array = isinstance(_make_mask(source, length, window, False), str)
        if mask.size <= VERIFIED_MASK and not _equal(mask, _make_mask(source, length, window, array)):
            return None
    else:
        return None

    def rows(c, n: int):
        return _make_mask(_mask_source(c), n, window, array)

    return rows


def _mask_source(cache):
    """The cache the model asks for a mask: the cache itself, or a CacheList's first."""
    from mlx_lm.models.cache import CacheList

    if isinstance(cache, CacheList):
        return cache[0] if all(_is_kv(c) for c in cache.caches) else None
    return cache if _is_kv(cache) else None


def _is_kv(cache) -> bool:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    return isinstance(cache, (KVCache, QuantizedKVCache, RotatingKVCache))


def _make_mask(source, n: int, window, array: bool):
    from mlx_lm.models.cache import RotatingKVCache

    if isinstance(source, RotatingKVCache):
        return source.make_mask(n, window_size=window, return_array=array)
    return source.make_mask(n, return_array=array, window_size=window)


def _equal(a, b) -> bool:
    if isinstance(b, str) or b is None:
        return False
    return a.shape[-2:] == b.shape[-2:] and bool(syncs.to_host(mx.all(a == b)))


# -- wrapping a model --------------------------------------------------------------------


@dataclass(frozen=True)
class Tiling:
    """What `tile_mixers` did to a model: the mixers wrapped, their tile, and why a model
    call must stay one tile long (None: it may be as large as memory allows). `captures`
    says whether the tiled mixers take every layer's cache, so a snapshot is copied inside
    a call (where they do not, a call ends at each snapshot and the whole cache is copied
    after it)."""

    wrapped: int
    tile: int
    limit: Optional[str]
    captures: bool = False


def _takes_cache(module: nn.Module) -> bool:
    try:
        return "cache" in inspect.signature(module.__call__).parameters
    except (TypeError, ValueError):
        return False


def _plain_call(module: nn.Module) -> bool:
    """Whether the module's call is mlx-lm's plain (x, mask, cache)."""
    params = list(inspect.signature(module.__call__).parameters.values())
    return len(params) <= 3 and [p.name for p in params][-1:] == ["cache"] and all(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
    )


def tile_mixers(model: nn.Module, tile: int = ATTENTION_TILE) -> Tiling:
    """Wrap every decoder layer's token mixer (a child taking the layer's cache, with
    mlx-lm's plain call) in a TiledMixer taking `tile` tokens at a time."""
    from mlx_lm.models.cache import make_prompt_cache

    layers = list(getattr(model, "layers", None) or [])
    wrapped, limit = 0, None
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            limit = limit or f"decoder layer {i} is not a module"
            continue
        for name, child in layer.children().items():
            for j, module in enumerate(child if isinstance(child, list) else [child]):
                if isinstance(module, TiledMixer):
                    module.tile = tile
                    wrapped += 1
                elif isinstance(module, nn.Module) and _takes_cache(module):
                    if not _plain_call(module):
                        limit = limit or f"{type(module).__name__} takes more than (x, mask, cache)"
                        continue
                    if isinstance(child, list):
                        child[j] = TiledMixer(module, tile)
                    else:
                        setattr(layer, name, TiledMixer(module, tile))
                    wrapped += 1
    if not layers:
        limit = "no decoder layers found"
    else:
        caches = make_prompt_cache(model)
        odd = [type(c).__name__ for c in caches if not _tileable_cache(c)]
        if odd:
            limit = limit or f"a {odd[0]} cannot be fed in tiles"
        elif wrapped < len(caches):
            limit = limit or f"{len(caches)} caches for {wrapped} mixers taking one"
    model._tiling = Tiling(wrapped, tile, limit, captures=limit is None and _captures(model))
    return model._tiling


def _captures(model: nn.Module) -> bool:
    """Whether the tiled mixers take every layer's cache: one token traced through the
    model (nothing computed, no expert read) shows which caches they are handed."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    p = Pass(0, (1,))
    try:
        with running(p), switch.tracing_only():
            model(mx.array([[0]]), cache=cache)
    except Exception:  # a model whose call this trace cannot make
        return False
    return all(_reached(p.seen, c) for c in cache)


def tiling_of(model: nn.Module) -> Tiling:
    return getattr(model, "_tiling", None) or Tiling(0, ATTENTION_TILE, "the mixers are not tiled")


def _tileable_cache(cache) -> bool:
    from mlx_lm.models.cache import ArraysCache, CacheList

    if isinstance(cache, CacheList):
        return _mask_source(cache) is not None
    return isinstance(cache, ArraysCache) or _is_kv(cache)


# -- feeding a prompt --------------------------------------------------------------------


def tile_ends(start: int, end: int, tile: int, marks) -> list[int]:
    """The tile ends of positions start..end: every `tile` tokens, counted again from each
    mark, as a prefill chunked at the marks would end its chunks; the marks included."""
    ends, at = [], start
    for stop in [*sorted(m for m in marks if start < m < end), end]:
        while at < stop:
            at = min(stop, at + tile)
            ends.append(at)
    return ends


def expert_chunks(ends: list[int], start: int, chunk: int) -> list[list[int]]:
    """The tile ends grouped into model calls of at most `chunk` tokens (a tile alone when
    it is longer)."""
    calls, current_start, current = [], start, []
    for e in ends:
        if current and e - current_start > chunk:
            calls.append(current)
            current_start, current = current[-1], []
        current.append(e)
    if current:
        calls.append(current)
    return calls


@dataclass
class Fed:
    """What `feed` did: the tokens now in the cache, the snapshots it kept
    [(position, cache)], its model calls, and what it could not tile."""

    tokens: int
    snapshots: list
    calls: int = 0
    untiled: int = 0


def feed(model, cache: list, prompt: list[int], start: int, end: int, *, chunk: int, marks=(), kv=None,
         on_chunk=None, between=None, embeddings=None, forward=None) -> Fed:
    """Feed prompt[start:end] into `cache` in expert chunks of at most `chunk` tokens, each
    one model call whose mixers run in the model's tiles (`tile_ends`); a copy of the cache is kept at
    each of `marks`. `kv` (engine/kv.KVSpec): mlx-lm's switch to a quantized cache after
    each tile. `on_chunk(fed)` after each call, `between()` after each tile and expert
    group; either may raise to stop. `embeddings`: the prompt's input embeddings (a
    vision-language model's), from `start`. `forward(tokens, embeddings)`: the call to
    make instead of `model(...)` (a drafter that reads hidden states)."""
    from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache

    quantize = kv.generate_kwargs() if kv is not None else {}
    tiling = tiling_of(model)
    marks = sorted(m for m in marks if start < m <= end)
    chunk = max(chunk, 1)
    if tiling.limit is not None:
        chunk = min(chunk, tiling.tile)
    ends = tile_ends(start, end, min(tiling.tile, chunk), marks)
    calls, begin = [], start
    for run in _split_at(ends, marks if not tiling.captures else ()):
        calls += expert_chunks(run, begin, chunk)
        begin = run[-1]
    fed = Fed(start, [])
    at = start
    with mx.stream(generation_stream):
        for ends in calls:
            tokens = mx.array(prompt[at:ends[-1]])[None]
            rows = None if embeddings is None else embeddings[at - start:ends[-1] - start][None]
            own = frozenset(m for m in marks if m in ends) if tiling.captures else frozenset()
            p = Pass(at, tuple(ends), own, quantize, between)
            with running(p):
                if forward is not None:
                    forward(tokens, rows)
                elif rows is not None:
                    model(tokens, cache=cache, input_embeddings=rows)
                else:
                    model(tokens, cache=cache)
                mx.eval([c.state for c in cache])  # as generate_step after each chunk
            given = list(cache)
            for i, c in enumerate(given):
                cache[i] = _resolved(p.replaced, c)
            if quantize:  # caches no tiled mixer took switch after the call, as after a chunk
                maybe_quantize_kv_cache(cache, quantize["quantized_kv_start"], quantize["kv_group_size"],
                                        quantize["kv_bits"])
            fed.snapshots += [(m, _snapshot(p, given, m)) for m in sorted(own)]
            if ends[-1] in marks and not own:  # a call that ends at a snapshot: the whole cache, copied
                fed.snapshots.append((ends[-1], _copied(cache)))
            fed.untiled += p.untiled
            fed.calls += 1
            at = fed.tokens = ends[-1]
            mx.clear_cache()
            if on_chunk is not None:
                on_chunk(at)
    fed.snapshots = [(m, s) for m, s in fed.snapshots if s is not None]
    return fed


def _split_at(ends: list[int], cuts) -> list[list[int]]:
    """The tile ends in runs that end at each of `cuts` (the model calls must end there)."""
    runs, current = [], []
    for e in ends:
        current.append(e)
        if e in cuts:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _reached(seen: set, c) -> bool:
    from mlx_lm.models.cache import CacheList

    return id(c) in seen or (isinstance(c, CacheList) and all(id(e) in seen for e in c.caches))


def _copied(cache: list) -> list:
    kept = copy.deepcopy(cache)
    syncs.evaluate([c.state for c in kept])
    return kept


def _resolved(found: dict, c):
    """`c`, or what `found` holds for it by id: for a CacheList whose elements the mixers
    took, a CacheList of what it holds for each (None where one is missing)."""
    from mlx_lm.models.cache import CacheList

    if id(c) in found:
        return found[id(c)]
    if isinstance(c, CacheList) and any(id(e) in found for e in c.caches):
        return CacheList(*(found.get(id(e), e) for e in c.caches))
    return c


def _snapshot(p: Pass, given: list, mark: int):
    """The cache as it stood at `mark`: each layer's copy taken there; None when a layer's
    cache was not copied (no tiled mixer took it)."""
    from mlx_lm.models.cache import CacheList

    copies = p.captured.get(mark, {})
    kept = []
    for c in given:
        if id(c) in copies:
            kept.append(copies[id(c)])
        elif isinstance(c, CacheList) and all(id(e) in copies for e in c.caches):
            kept.append(CacheList(*(copies[id(e)] for e in c.caches)))
        else:
            return None
    return kept
