"""The streaming replacement for mlx-lm's expert containers (`SwitchGLU`, `SwitchMLP`).

The mlx-lm container is kept, with its stacked `(E, ...)` tensors swapped for the
pool's `(S, ...)` slot arrays, so routing, scoring, activations and the gather kernels
stay mlx-lm's own: the only difference is that expert ids are remapped to slot ids.
"""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from .. import syncs
from ..activity import ACTIVITY
from ..values import ROUTES_AT_ONCE
from .index import LayerExperts
from .pool import ExpertPool
from .store import ExpertStore

SORT_THRESHOLD = 64  # mlx-lm's SwitchGLU sorts routes by expert from this many on
_local = threading.local()  # MLX streams belong to the thread that made them, and hooks to their prefill


@contextmanager
def tracing_only():
    """Calls on this thread return zeros of the right shape, computing and reading
    nothing: a model call that only follows which modules take which cache
    (engine/prefill.py) costs no expert read."""
    _local.tracing = True
    try:
        yield
    finally:
        _local.tracing = False


@contextmanager
def between_groups(hook):
    """Call `hook()` on this thread between the expert groups of a long call (a prompt's
    expert chunk): a request's cancellation, other requests' decode steps. None: none."""
    outer = getattr(_local, "between", None)
    _local.between = hook
    try:
        yield
    finally:
        _local.between = outer


def side_stream():
    """A second CPU stream, so a decode call's routes run on two cores; None on a GPU,
    where one stream already uses the whole device."""
    if not hasattr(_local, "side"):
        _local.side = mx.new_stream(mx.cpu) if mx.default_device() == mx.cpu else None
    return _local.side


class StreamingExperts(nn.Module):
    """Calls the mlx-lm container over resident slots, loading misses first."""

    def __init__(self, container: nn.Module, layout: LayerExperts, ordinal: int):
        super().__init__()
        self.experts = container
        self.layout = layout  # where this layer's experts live on disk
        self.ordinal = ordinal  # position among the model's MoE layers
        self.pool: ExpertPool | None = None  # set by the loader
        self.observer = None  # called with (layer, needed ids, single token) when tracing
        self.overlap = None  # the model's Overlap (experts/prefetch.py), set by the loader
        self.ahead = None  # (next MoE layer's module, its Router): what to read ahead for

    def __call__(self, x: mx.array, indices: mx.array, *args, **kwargs) -> mx.array:
        if getattr(_local, "tracing", False):
            return mx.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)
        pool = self.pool
        if args or kwargs:
            return self._passing_on(x, indices, args, kwargs)
        single_token = indices.size == indices.shape[-1]
        if not single_token:
            ACTIVITY.moe_layer(self.ordinal)  # a prompt chunk's progress through the layers (the dashboard)
        # A decode step or a short verify pass (speculation): below mlx-lm's sorting
        # threshold every route is computed alone, so the routes may be split.
        few_routes = indices.size < SORT_THRESHOLD
        many = indices.size > ROUTES_AT_ONCE  # a prompt chunk: computed a bounded group at a time
        if pool.whole and self.observer is None and not many:
            # Every expert resident: no need to read the router's choice back.
            pool.counters.hits += indices.size
            pool.counters.calls_no_load += 1
            slots = pool.remap(indices)
            return self._two_ways(x, slots) if few_routes else self.experts(x, slots)
        ids = syncs.to_host(indices).reshape(-1)
        unique, first = np.unique(ids, return_index=True)
        needed = unique[np.argsort(first)]  # in the order the router named them
        if self.observer is not None:
            self.observer(self.ordinal, needed, single_token)
        if len(needed) <= pool.slots and not many:
            if single_token and few_routes:
                return self._decode_call(x, indices, ids, needed)
            self._load(needed, ids)
            if few_routes:
                return self._two_ways(x, pool.remap(indices))
            return self.experts(x, pool.remap(indices))
        return self._expert_major(x, indices, ids, needed)

    def _passing_on(self, x, indices, args, kwargs) -> mx.array:
        """A call with arguments beyond the routes, which only the container understands:
        one container call over the slots of every expert the call routes to."""
        ids = syncs.to_host(indices).reshape(-1)
        needed = np.unique(ids)
        if len(needed) > self.pool.slots:
            raise RuntimeError(
                f"MoE layer {self.ordinal}: a call with container arguments routes to "
                f"{len(needed)} experts, more than the {self.pool.slots} slots"
            )
        self._load(needed, ids)
        return self.experts(x, self.pool.remap(indices), *args, **kwargs)

    def _load(self, needed, ids) -> None:
        """Make `needed` resident; every route in `ids` must then have its slot."""
        self.pool.ensure(needed)
        if self.pool.unplaced(ids):
            raise RuntimeError(f"MoE layer {self.ordinal}: routes without a slot")

    def _two_ways(self, x, slots: mx.array) -> mx.array:
        """The container over a decode call's routes, the first half on the side stream
        (when there is one) and the second on the default stream, at the same time."""
        side, k = side_stream(), slots.shape[-1]
        if side is None or not 2 <= k < SORT_THRESHOLD:  # halves must not change mlx-lm's sorting
            return self.experts(x, slots)
        with mx.stream(side):
            first = self.experts(x, slots[..., : k // 2])
        return mx.concatenate([first, self.experts(x, slots[..., k // 2 :])], axis=-2)

    def _decode_call(self, x, indices, ids, needed) -> mx.array:
        """A decode call. Where the model's `overlap` says so (on a GPU; on the CPU
        backend where the misses wait on the device) the resident routes are computed
        while the misses are read; otherwise the misses are read first and both streams
        then share the routes, because page-cache reads and compute compete for the same
        cores (docs/benchmarks.md). Then the next layer's predicted experts may be read
        ahead (experts/prefetch.py).

        Each route's output is computed alone either way (below mlx-lm's sorting
        threshold), so splitting the routes in two and putting them back in router order
        gives the container's exact result. The misses' slots are never among the
        resident routes' slots: `ensure` does not evict an expert the call needs.
        """
        pool, side = self.pool, side_stream()
        resident = pool.slot_of[ids] >= 0
        if resident.all() or not resident.any() or not self._splits(needed, side is None):
            self._load(needed, ids)
            self._read_ahead(x, indices, side is None)
            return self._two_ways(x, pool.remap(indices))
        lead = indices.shape[:-1]
        hit, miss = np.nonzero(resident)[0], np.nonzero(~resident)[0]
        # both CPU streams compute the resident routes while the reader threads, asleep
        # on the device, fill the misses' slots
        y_hit = self._two_ways(x, mx.array(pool.slot_of[ids[hit]]).reshape(*lead, -1))
        mx.async_eval(y_hit)
        pool.counters.overlapped += 1
        self._load(needed, ids)
        self._read_ahead(x, indices, side is None)
        y_miss = self._two_ways(x, mx.array(pool.slot_of[ids[miss]]).reshape(*lead, -1))
        order = mx.array(np.argsort(np.concatenate([hit, miss])))
        return mx.take(mx.concatenate([y_hit, y_miss], axis=-2), order, axis=-2)

    def _splits(self, needed, gpu: bool) -> bool:
        if self.overlap is None:
            return gpu
        return self.overlap.split(self.pool, needed[self.pool.slot_of[needed] < 0], gpu)

    def _read_ahead(self, x, indices, gpu: bool) -> None:
        """Start reading what the next MoE layer is predicted to route to."""
        if self.overlap is not None and self.ahead is not None:
            module, router = self.ahead
            if module.pool is not None and not module.pool.whole:
                self.overlap.read_ahead(module.pool, router, x, indices.shape[-1], gpu)

    def _expert_major(self, x, indices, ids, needed) -> mx.array:
        """A call with more distinct experts than slots, or more routes than are computed
        at once (a prompt chunk): its experts in groups that fit the pool, resident ones
        first, each expert read once, the routes of a group `ROUTES_AT_ONCE` at a time.

        Where the model's `overlap` says so (on a GPU; on the CPU backend where reads wait
        on the device), each group takes half the slots and the next group is read into
        the other half while it computes, so a read-bound prefill takes about the longer
        of its reads and its compute, not their sum."""
        pool = self.pool
        k = indices.shape[-1]
        do_sort = indices.size >= SORT_THRESHOLD  # mlx-lm's choice for the whole call
        resident = pool.slot_of[needed] >= 0
        order = np.concatenate([needed[resident], needed[~resident]])
        ahead = pool.slots >= 2 and not resident.all() and self._splits(order, side_stream() is None)
        size = pool.slots // 2 if ahead else pool.slots
        groups = [order[start : start + size] for start in range(0, len(order), size)]
        between = getattr(_local, "between", None)
        rows = x.reshape(-1, 1, x.shape[-1])
        out = None
        for g, group in enumerate(groups):
            pool.ensure(group)
            routes = np.nonzero(np.isin(ids, group))[0]
            slots = pool.slot_of[ids[routes]]
            if (slots < 0).any():
                pool.counters.unplaced += int((slots < 0).sum())
                raise RuntimeError(f"MoE layer {self.ordinal}: routes without a slot")
            by_slot = np.argsort(slots, kind="stable")
            routes, slots = routes[by_slot], slots[by_slot]
            for start in range(0, len(routes), ROUTES_AT_ONCE):
                part = slice(start, start + ROUTES_AT_ONCE)
                y = self._apply_halves(rows[mx.array(routes[part] // k)], slots[part], do_sort)
                if out is None:
                    out = mx.zeros((ids.size, *y.shape[1:]), dtype=y.dtype)
                out[mx.array(routes[part])] = y
                if start + ROUTES_AT_ONCE < len(routes):
                    syncs.evaluate(out)  # one part's intermediates at a time
            if ahead and g + 1 < len(groups):
                mx.async_eval(out)
                pool.start_prefetch(groups[g + 1], keep=group)
            syncs.evaluate(out)  # before a later group's reads overwrite these slots
            if between is not None:
                between()
        return out.reshape(*indices.shape, out.shape[-1])

    def _apply_halves(self, rows, slots: np.ndarray, sorted_indices) -> mx.array:
        """`_apply` over a chunk's routes, on the CPU backend split at the middle route
        so the side stream computes the first half on the second core: each route's
        output is its own (row, slot) product, so the halves give the whole call's
        values. On a GPU the one stream already fills the device."""
        side, half = side_stream(), len(slots) // 2
        if side is None or half == 0:
            return self._apply(rows, mx.array(slots), sorted_indices)
        with mx.stream(side):
            first = self._apply(rows[:half], mx.array(slots[:half]), sorted_indices)
        return mx.concatenate([first, self._apply(rows[half:], mx.array(slots[half:]), sorted_indices)])

    def _apply(self, x, slots, sorted_indices) -> mx.array:
        """The container's computation on explicit (row, slot) pairs."""
        c = self.experts
        if "gate_proj" in c:
            up = c.up_proj(x, slots, sorted_indices=sorted_indices)
            gate = c.gate_proj(x, slots, sorted_indices=sorted_indices)
            return c.down_proj(c.activation(up, gate), slots, sorted_indices=sorted_indices)
        hidden = c.activation(c.fc1(x, slots, sorted_indices=sorted_indices))
        return c.fc2(hidden, slots, sorted_indices=sorted_indices)


def expert_containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every expert container (`SwitchGLU`, `SwitchMLP` of mlx-lm, and of mlx-vlm once a
    vision-language model has imported it) in the model, by module path, in layer order:
    what `StreamingExperts` replaces."""
    import sys

    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    kinds = (SwitchGLU, SwitchMLP)
    vlm = sys.modules.get("mlx_vlm.models.switch_layers")  # never imported for a text model
    if vlm is not None:
        kinds += (vlm.SwitchGLU, vlm.SwitchMLP)
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]
    return sorted(found, key=lambda item: [int(n) for n in re.findall(r"\d+", item[0])])


def attach_pool(module: StreamingExperts, dtypes: dict, slots: int | None, store: ExpertStore,
                policy: str) -> ExpertPool:
    """Give `module` a new pool of `slots` (None: one per expert), filled when whole."""
    if slots is None:
        slots = module.layout.num_experts
    pool = ExpertPool(module.layout, slots, dtypes, store, policy)
    if module.pool is not None:
        module.pool.settle_prefetch()  # no read may still land in the old slots
    module.experts.update(tree_unflatten(list(pool.arrays.items())))
    module.pool = None  # drop the old slots before filling the new ones
    if pool.slots == pool.num_experts:
        pool.fill()
    module.pool = pool
    return pool
