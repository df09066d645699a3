"""When a decode call's reads overlap its compute, and reads ahead for the next MoE layer.

Where reads wait on the device, the cores idle while they wait, so a decode call then
computes its resident experts while its misses are read, and starts reading the experts
the next MoE layer is predicted to route to, which land while this layer and the next
layer's attention compute. The prediction is the next layer's router applied to this
layer's input; it only chooses what is read ahead, never what is computed, so the
output is exact. Where the page cache serves the reads they are memory copies that need
the cores the compute uses, and on the CPU backend reading first then computing on two
streams measured faster (docs/benchmarks.md), so `auto` looks, per call, at whether the
records to read are in the page cache (mincore) before choosing.

On a GPU (Metal) a decode call always overlaps its reads with the GPU's compute (the
reads are the CPU's work); a prediction would add a host read-back of the next router's
choice per layer, so there `auto` does not read ahead and only `on` does.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import syncs
from ..values import OVERLAP_MODES, one_of

FROM_DISK = 0.5  # a read counts as waiting on the device from this share of pages uncached
SAMPLED = 2  # experts whose pages are looked up per decision


class Overlap:
    """One per loaded model: the mode, and the per-call choices every layer asks for."""

    def __init__(self, mode: str = "auto"):
        one_of("overlap", mode, OVERLAP_MODES)
        self.mode = mode
        self.disk = None  # auto: whether the last call's misses waited on the device

    def split(self, pool, misses, gpu: bool) -> bool:
        """Whether a decode call computes its resident routes while `misses` are read."""
        if self.mode == "off":
            return False
        if self.mode == "on" or gpu:
            return True
        self.disk = self._from_disk(pool, misses)
        return self.disk

    def read_ahead(self, pool, router, x: mx.array, k: int, gpu: bool) -> int:
        """Start reading the `k` experts `router` ranks highest for `x` into `pool`
        (the next MoE layer's), when the mode says so; returns the experts started."""
        if self.mode == "off" or router.hidden != x.shape[-1]:
            return 0
        if self.mode == "auto" and (gpu or self.disk is False):  # no prediction where reads are copies
            return 0
        predicted = predict(router, x, min(k, pool.slots))
        missing = predicted[pool.slot_of[predicted] < 0]
        if not len(missing):
            return 0
        if self.mode == "auto":
            self.disk = self._from_disk(pool, missing)
            if not self.disk:
                return 0
        return pool.start_prefetch(predicted)

    @staticmethod
    def _from_disk(pool, experts) -> bool:
        share = pool.uncached_share(experts[:SAMPLED])
        return share is not None and share >= FROM_DISK


def predict(router, x: mx.array, k: int) -> np.ndarray:
    """The `k` experts `router` scores highest for the one token `x`."""
    scores = router(x.reshape(-1, x.shape[-1]))[0]
    return syncs.to_host(mx.argpartition(-scores, k - 1)[:k]).astype(np.int64)


class Router:
    """An MoE block's router as `x -> a score per expert`, for predictions only."""

    def __init__(self, fn, hidden: int):
        self.fn, self.hidden = fn, hidden

    def __call__(self, x: mx.array) -> mx.array:
        return self.fn(x)


def find_router(block: nn.Module, num_experts: int) -> Router | None:
    """The router of an MoE block: its linear layer to `num_experts` outputs (plain or
    quantized), or a gate module holding an `(num_experts, hidden)` weight (its bias,
    norm and grouping left out: a prediction only steers reads); else the same one level
    down inside a child named like a router or gate (`router.layer`, `gate.wg`), where
    extra outputs past `num_experts` (zero experts) are dropped. None if there is none."""
    children = block.children()
    for child in children.values():
        if (router := _scorer(child, num_experts, exact=True)) is not None:
            return router
    for name, child in children.items():
        if ("router" in name or "gate" in name) and isinstance(child, nn.Module):
            for inner in child.children().values():
                if (router := _scorer(inner, num_experts, exact=False)) is not None:
                    return router
    return None


def _scorer(module, num_experts: int, exact: bool) -> Router | None:
    """`module` as a Router when it maps the hidden state to a score per expert."""
    if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        rows, cols = module.weight.shape
        if rows == num_experts or (not exact and rows > num_experts):
            bits = module.bits if isinstance(module, nn.QuantizedLinear) else 32
            return Router(lambda x, m=module: m(x)[..., :num_experts], cols * 32 // bits)
    elif isinstance(module, nn.Module) and isinstance(w := module.get("weight"), mx.array):
        if w.ndim == 2 and (w.shape[0] == num_experts or (not exact and w.shape[0] > num_experts)):
            return Router(lambda x, w=w[:num_experts]: x @ w.T.astype(x.dtype), w.shape[1])
    return None
