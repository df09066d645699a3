"""The sliding-window cache kept in full precision next to quantized layers.

Its own module because it subclasses an mlx-lm class, and `engine/kv.py` must not
import mlx (the planner and the settings use it).
"""

from __future__ import annotations

from mlx_lm.models.cache import RotatingKVCache


class FullPrecisionWindow(RotatingKVCache):
    """mlx-lm's `maybe_quantize_kv_cache` quantizes every cache that has `to_quantized`,
    and `RotatingKVCache.to_quantized` raises (not implemented); this one has none, so
    a model's sliding-window layers stay as they are while its other layers are
    quantized."""

    @property
    def to_quantized(self):
        raise AttributeError("a sliding-window cache stays full precision")
