"""KV-cache policy: whether, and how, the attention cache is quantized.

mlx-lm quantizes a prompt cache itself when `stream_generate` is given `kv_bits`:
after each prefill chunk and each decode step, every cache that has `to_quantized`
and holds at least `quantized_kv_start` tokens becomes a `QuantizedKVCache`. The
engine hands it the same three values, so the arithmetic is mlx-lm's and a response
compares bit for bit with `mlx_lm.generate(..., kv_bits=...)`. What this module adds
is what mlx-lm leaves to its caller:

- the values are checked against the model before anything runs (one line);
- sliding-window caches, which mlx-lm cannot quantize (`RotatingKVCache.to_quantized`
  raises), are made as `FullPrecisionWindow`s, so they keep full precision while the
  model's full-attention layers are quantized; linear-attention state (`ArraysCache`)
  has nothing to quantize and stays as it is;
- a model whose attention cannot read a quantized cache (attention sinks, a latent
  MLA cache, code that reads `values.dtype` off what the cache returns) runs with a
  full-precision cache and a `kv_note` saying why.

Nothing here imports mlx at module level: the planner sizes quantized caches from
the same arithmetic without loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from .. import values
from ..checkpoints.support import cached_array_reads, model_module
from ..checkpoints.vision import takes_images
from ..values import KV_GROUP_SIZES


class KVError(ValueError):
    """A KV setting this model cannot run with; the message is one line."""


@dataclass(frozen=True)
class KVSpec:
    """How the attention cache is kept: `bits` None is full precision."""

    bits: Optional[int] = None
    group_size: int = 64
    start: int = 0  # tokens in the cache before it is quantized (mlx-lm's quantized_kv_start)

    def __post_init__(self) -> None:
        check_values(self.bits, self.group_size, self.start)

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def generate_kwargs(self) -> dict:
        """The arguments mlx-lm's `stream_generate` takes for this layout."""
        if not self.quantized:
            return {}
        return {"kv_bits": self.bits, "kv_group_size": self.group_size, "quantized_kv_start": self.start}

    def describe(self) -> str:
        if not self.quantized:
            return "full precision"
        start = f", from token {self.start}" if self.start else ""
        return f"{self.bits}-bit (groups of {self.group_size}{start})"


def check_values(bits, group_size, start) -> None:
    """KVError (one line) unless the values are a layout mlx-lm can keep."""
    for name, check, value in (("kv_bits", values.kv_bits, bits), ("kv_group_size", values.kv_group_size, group_size),
                               ("kv_start", values.kv_start, start)):
        try:
            check(value)
        except ValueError as exc:
            raise KVError(f"{name} {exc}") from None


FULL_PRECISION = KVSpec()


# -- what a model allows -------------------------------------------------------------


def blocker(config: dict, weight_names: Iterable[str]) -> Optional[str]:
    """Why this model's attention cannot read a quantized cache (None: it can).

    From the config and the weight names alone, so the planner (headers only) and the
    engine (a loaded model) agree.
    """
    if _field(config, "kv_lora_rank"):
        return "its attention caches a compressed latent (MLA), which mlx-lm does not quantize"
    if any(name.rsplit(".", 1)[-1] == "sinks" for name in weight_names):
        return "its attention uses sinks, which mlx-lm's quantized attention does not support"
    if takes_images(config):
        return "its attention is mlx-vlm's, which no test checks against a quantized cache"
    if config.get("model_type"):
        module = model_module(config)
        reads = cached_array_reads(module)
        if reads:
            return (f"its attention (mlx-lm's {module}.py) reads {', '.join(reads)} off the cached "
                    "keys and values, which a quantized cache does not have")
    return None


def head_dims(config: dict) -> set[int]:
    """The last dimensions of the cached keys and values (what a group must divide)."""
    heads = int(_field(config, "num_attention_heads") or 1)
    dims = {int(_field(config, "head_dim") or int(_field(config, "hidden_size") or 0) // heads)}
    if _field(config, "v_head_dim"):
        dims.add(int(_field(config, "v_head_dim")))
    return {d for d in dims if d}


def check_model(spec: KVSpec, config: dict) -> None:
    """KVError when the group size does not divide the model's head dimension."""
    if not spec.quantized:
        return
    for dim in sorted(head_dims(config)):
        if dim % spec.group_size:
            fits = [str(g) for g in KV_GROUP_SIZES if dim % g == 0]
            hint = (
                f"use kv_group_size {' or '.join(fits)}" if fits
                else f"no group size ({', '.join(map(str, KV_GROUP_SIZES))}) divides it, so use kv_bits off"
            )
            raise KVError(
                f"kv_group_size {spec.group_size} does not divide this model's head dimension {dim}; {hint}"
            )


def _field(config: dict, key: str):
    if key in config:
        return config[key]
    return (config.get("text_config") or {}).get(key)


# -- caches --------------------------------------------------------------------------


def make_cache(model, spec: KVSpec) -> list:
    """mlx-lm's prompt cache for `model`; with a quantized spec, its sliding windows are
    `FullPrecisionWindow`s so that mlx-lm's quantization step passes them by."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    from .kv_window import FullPrecisionWindow

    cache = make_prompt_cache(model)
    if spec.quantized:
        cache = [
            FullPrecisionWindow(c.max_size, c.keep) if type(c) is RotatingKVCache else c for c in cache
        ]
    return cache


def rewinds(cache) -> bool:
    """Whether `cache` can be cut back to any shorter prefix, whatever it holds: every
    layer a growing attention cache (mlx-lm's KVCache, or the QuantizedKVCache it becomes;
    mlx-vlm's own classes of them for a vision-language model). A linear-attention state,
    a sliding window and a chunked-attention cache cannot (the last two only until they
    wrap or pass a chunk), so those resume from prompt snapshots (engine/prompt_cache.py).
    The one test of it: the prompt cache, the conversation cache on disk and the memory
    plan (on the cache mlx-lm makes for a config) ask it."""
    import sys

    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    growing = {KVCache, QuantizedKVCache}
    vlm = sys.modules.get("mlx_vlm.models.cache")  # imported with any model whose caches are its classes
    if vlm is not None:
        growing |= {vlm.KVCache, vlm.QuantizedKVCache}
    return all(type(c) in growing for c in cache)


def cache_bytes(cache) -> int:
    """Bytes the caches hold (allocated, including mlx-lm's growth steps)."""
    total = 0
    for c in cache or ():
        try:
            if not c.empty():
                total += int(c.nbytes)
        except (AttributeError, NotImplementedError):
            continue
    return total


def bits_in_use(cache) -> Optional[int]:
    """The bits of the quantized caches (None: none is quantized yet)."""
    for c in cache or ():
        bits = getattr(c, "bits", None)
        if bits is not None:
            return int(bits)
    return None


def bytes_per_element(spec: KVSpec, width: int) -> float:
    """Bytes one cached key or value element takes: `width` unquantized; quantized, its
    bits plus a scale and a bias (activation width each) per group."""
    if not spec.quantized:
        return float(width)
    return spec.bits / 8 + 2 * width / spec.group_size


def layout_for(spec: KVSpec, config: dict, weight_names: Iterable[str]) -> tuple[KVSpec, Optional[str]]:
    """(the layout the model will really run with, a note when it differs from `spec`).

    A model that cannot read a quantized cache falls back to full precision with a
    note; a group size that does not divide the head dimension is a KVError.
    """
    if not spec.quantized:
        return spec, None
    reason = blocker(config, weight_names)
    if reason:
        return FULL_PRECISION, f"kv_bits {spec.bits} not applied: {reason}; the KV cache stays full precision"
    check_model(spec, config)
    return spec, None


def kept_note(cache) -> Optional[str]:
    """Which layers a quantized layout leaves unquantized, e.g. "2 sliding-window layers
    kept full precision" (None when every layer with a cache is quantized)."""
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    windows = sum(isinstance(c, RotatingKVCache) for c in cache or ())
    linear = sum(isinstance(c, ArraysCache) for c in cache or ())
    parts = []
    if windows:
        parts.append(f"{windows} sliding-window layer{'s' if windows != 1 else ''} kept full precision")
    if linear:
        parts.append(f"{linear} linear-attention layer{'s' if linear != 1 else ''} keep their fixed state")
    return "; ".join(parts) or None


# -- caches on disk (for a conversation cache that saves and loads prompt caches) --------


def for_saving(cache) -> list:
    """The caches as mlx-lm's `save_prompt_cache` can name them: a FullPrecisionWindow
    (not one of mlx-lm's classes, which `load_prompt_cache` looks names up in) is saved
    as the RotatingKVCache it is; a class that mlx-lm could not load back is a ValueError."""
    from mlx_lm.models import cache as mlx_cache
    from mlx_lm.models.cache import RotatingKVCache

    from .kv_window import FullPrecisionWindow

    out = []
    for c in cache:
        name = type(c).__name__
        if type(c) is not FullPrecisionWindow and getattr(mlx_cache, name, None) is not type(c):
            # load_prompt_cache looks each class up by name in mlx_lm.models.cache
            raise ValueError(f"mlx-lm's load_prompt_cache cannot load this model's cache class {name} "
                             f"({type(c).__module__})")
        if type(c) is FullPrecisionWindow:
            plain = RotatingKVCache(c.max_size, c.keep)
            plain.state = c.state
            c = plain
        out.append(c)
    return out


def after_loading(cache, expected) -> list:
    """Caches from mlx-lm's `load_prompt_cache`, given back the classes of `expected`
    (a fresh `make_cache`): a RotatingKVCache where a FullPrecisionWindow is expected
    becomes one again."""
    from mlx_lm.models.cache import RotatingKVCache

    from .kv_window import FullPrecisionWindow

    out = []
    for c, want in zip(cache, expected):
        if type(c) is RotatingKVCache and type(want) is FullPrecisionWindow:
            window = FullPrecisionWindow(c.max_size, c.keep)
            window.state = c.state
            c = window
        out.append(c)
    return out + list(cache[len(out):])


def same_layout(cache, expected) -> bool:
    """Whether `cache` is what `expected` (a fresh `make_cache`) becomes as it fills: the
    same class per layer, a KVCache having become mlx-lm's QuantizedKVCache allowed."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if len(cache) != len(expected):
        return False
    return all(type(c) is type(want) or (type(c) is QuantizedKVCache and type(want) is KVCache)
               for c, want in zip(cache, expected))
