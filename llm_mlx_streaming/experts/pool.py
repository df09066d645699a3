"""The resident experts of one MoE layer: a fixed number of slots, filled on demand.

Per component (e.g. `up_proj.weight`) the pool holds one `(S, ...)` MLX array; the
streaming module computes over these with expert ids remapped to slot ids through a
device-side expert->slot map. Misses are read from disk straight into the slot buffers
(in place: nothing lazy reads a pool array while it is written, because every call
that read it was evaluated before the next call of the same layer can start).
"""

from __future__ import annotations

from concurrent.futures import wait
from dataclasses import dataclass, fields

import mlx.core as mx
import numpy as np

from .index import LayerExperts
from .policies import DEFAULT_POLICY, make_policy
from .store import ExpertStore, ReadResult


@dataclass
class PoolCounters:
    """What one pool (or all of them, summed) did."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # wall time of the (parallel) reads
    reads: int = 0  # preadv calls (contiguous jobs are merged into one)
    calls_no_load: int = 0  # layer calls whose experts were all resident (any backend)
    calls_loaded: int = 0  # layer calls that had to read experts first
    overlapped: int = 0  # decode calls whose resident routes ran while the misses were read
    prefetch_loads: int = 0  # experts read ahead of their layer's call (experts/prefetch.py)
    prefetch_hits: int = 0  # of those, the ones that call then routed to
    unplaced: int = 0  # routes without their own expert's slot: must stay 0

    def add(self, other: "PoolCounters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    @property
    def read_mb_per_s(self) -> float:
        """Achieved read throughput (0.0 before any read)."""
        return self.bytes_read / self.read_seconds / 1e6 if self.read_seconds else 0.0

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["hit_rate"] = self.hit_rate
        d["read_mb_per_s"] = self.read_mb_per_s
        return d


class ExpertPool:
    """Slots, expert->slot map, eviction policy and counters of one MoE layer."""

    def __init__(
        self,
        layout: LayerExperts,
        slots: int,
        dtypes: dict[str, mx.Dtype],
        store: ExpertStore,
        policy: str = DEFAULT_POLICY,
    ):
        if slots < 1:
            raise ValueError(f"expert_slots must be at least 1, got {slots}")
        self.layout = layout  # where each expert's bytes are on disk
        self.num_experts = layout.num_experts
        self.slots = min(int(slots), self.num_experts)
        self.store = store
        self.policy = make_policy(policy, self.slots)
        self.counters = PoolCounters()
        # per expert, for the dashboard's heatmap: calls that needed it, and of those the misses
        self.expert_lookups = np.zeros(self.num_experts, dtype=np.int64)
        self.expert_misses = np.zeros(self.num_experts, dtype=np.int64)
        self.arrays: dict[str, mx.array] = {}
        self._views: dict[str, np.ndarray] = {}
        for comp in layout.components:
            arr = mx.zeros((self.slots, *comp.shape), dtype=dtypes[comp.name])
            mx.eval(arr)
            view = np.frombuffer(memoryview(arr), dtype=np.uint8)
            self.arrays[comp.name] = arr
            self._views[comp.name] = view.reshape(self.slots, comp.stride)
        self.slot_of = np.full(self.num_experts, -1, dtype=np.int32)
        self.expert_in = np.full(self.slots, -1, dtype=np.int32)
        self._free = list(range(self.slots - 1, -1, -1))
        self.device_map = mx.zeros((self.num_experts,), dtype=mx.int32)
        self.identity = False  # slot == expert for every expert: no remap needed
        self._ahead = None  # (targets, future): slots taken, bytes landing in the background
        self._prefetched: set[int] = set()  # read ahead and published, not yet routed to

    @property
    def whole(self) -> bool:
        """Every expert of the layer is resident."""
        return self.slots == self.num_experts and not self._free

    def ensure(self, needed) -> int:
        """Make every expert in `needed` (distinct ids, at most `slots`) resident.

        Returns the number of experts loaded. Experts in `needed` are never evicted.
        """
        if len(needed) > self.slots:
            raise ValueError(f"{len(needed)} experts cannot fit in {self.slots} slots")
        self.settle_prefetch()
        protected = set(int(e) for e in needed)
        if self._prefetched:
            self.counters.prefetch_hits += len(self._prefetched & protected)
            self._prefetched.clear()
        misses = []
        for e in needed:
            e = int(e)
            if self.slot_of[e] >= 0:
                self.policy.record(e)
            else:
                misses.append(e)
        c = self.counters
        c.hits += len(needed) - len(misses)
        self.expert_lookups[needed] += 1  # distinct ids: one numpy call, no host sync
        if not misses:
            c.calls_no_load += 1
            return 0
        c.calls_loaded += 1
        try:
            targets = [(e, self._take_slot(protected)) for e in misses]
            result = self._read(targets)
            for e, slot in targets:
                self.slot_of[e] = slot
                self.expert_in[slot] = e
                self.policy.record(e)
            self._publish_map()
        except BaseException:
            # Whatever step was interrupted (an eviction half done, a read, the
            # publishing), nothing half-read may ever be used and no slot may be lost.
            self._reconcile()
            raise
        c.misses += len(targets)
        self.expert_misses[misses] += 1
        c.bytes_read += result.nbytes
        c.read_seconds += result.seconds
        c.reads += result.reads
        return len(targets)

    def _take_slot(self, protected: set[int]) -> int:
        """A free slot, else the slot of the policy's victim (never one in `protected`),
        left empty until its new expert's bytes have landed."""
        if self._free:
            return self._free.pop()
        victim = self.policy.victim(self._resident(), protected)
        slot = int(self.slot_of[victim])
        self.slot_of[victim] = -1
        self.expert_in[slot] = -1
        self.policy.forget(victim)
        self._prefetched.discard(victim)
        self.counters.evictions += 1
        return slot

    def start_prefetch(self, predicted, keep=()) -> int:
        """Begin reading the `predicted` experts that are not resident, in the
        background, into free slots or the slots of victims outside `predicted` and
        `keep` (experts a computation in flight reads).

        Nothing is published (and no policy told) until `settle_prefetch`, which every
        other use of the pool runs first; returns the number of experts started."""
        self.settle_prefetch()
        predicted = list(dict.fromkeys(int(e) for e in predicted))
        protected = set(predicted) | {int(e) for e in keep if self.slot_of[int(e)] >= 0}
        room = self.slots - sum(1 for e in protected if self.slot_of[e] >= 0)
        wanted = [e for e in predicted if self.slot_of[e] < 0][: max(room, 0)]
        if not wanted:
            return 0
        try:
            targets = [(e, self._take_slot(protected)) for e in wanted]
            self._ahead = (targets, self.store.background(self._read, targets))
        except BaseException:
            self._reconcile()
            raise
        return len(targets)

    def settle_prefetch(self) -> None:
        """Wait for the prefetch in flight and publish what it read.

        A failed read frees its slots (the call that needs those experts reads them
        itself, and reports the error if it persists); an interrupt waits until the read
        has stopped writing before the slots are freed."""
        if self._ahead is None:
            return
        targets, future = self._ahead
        try:
            result = future.result()
            self._ahead = None
            for e, slot in targets:
                self.slot_of[e] = slot
                self.expert_in[slot] = e
            self._publish_map()
        except OSError:
            self._ahead = None
            self._reconcile()
            return
        except BaseException:
            _wait_out(future)
            self._ahead = None
            self._reconcile()
            raise
        self._prefetched.update(e for e, _ in targets)
        c = self.counters
        c.prefetch_loads += len(targets)
        c.bytes_read += result.nbytes
        c.read_seconds += result.seconds
        c.reads += result.reads

    def uncached_share(self, experts) -> float | None:
        """Share of the `experts`' bytes on disk that the page cache does not hold (None:
        unknown): whether reading them waits on the device."""
        packed = self.store.packed.layer(self.layout.key) if self.store.packed else None
        if packed is not None:
            ranges = [(packed.file, packed.offset(int(e)), packed.expert_bytes) for e in experts]
        else:
            ranges = [(c.file, *c.span(int(e))) for e in experts for c in self.layout.components]
        return self.store.uncached_share(ranges)

    def _reconcile(self) -> None:
        """After a failed or interrupted `ensure`: a slot holds an expert only when both
        maps agree; every other slot is free again, and the device map says so (a slot a
        prefetch is still reading into stays taken until `settle_prefetch`)."""
        occupied = {slot for _, slot in self._ahead[0]} if self._ahead else set()
        self._prefetched &= {int(e) for e in self.expert_in if e >= 0}
        for slot, e in enumerate(self.expert_in):
            if e >= 0 and self.slot_of[e] == slot:
                occupied.add(slot)
            elif e >= 0:
                self.expert_in[slot] = -1
                self.policy.forget(int(e))
        for e, slot in enumerate(self.slot_of):
            if slot >= 0 and slot not in occupied:
                self.slot_of[e] = -1
                self.policy.forget(e)
        self._free = [s for s in range(self.slots - 1, -1, -1) if s not in occupied]
        self._publish_map()

    def fill(self) -> None:
        """Load every expert (a pool with a slot per expert), slot i = expert i."""
        if self.slots != self.num_experts:
            raise ValueError("fill() needs a slot for every expert")
        self._free = sorted(self._free, reverse=True)  # pop() hands out slot 0 first
        missing = [e for e in range(self.num_experts) if self.slot_of[e] < 0]
        for start in range(0, len(missing), 64):
            self.ensure(missing[start : start + 64])
        self.identity = bool(np.array_equal(self.slot_of, np.arange(self.num_experts)))

    def _read(self, targets: list[tuple[int, int]]) -> ReadResult:
        """Read each (expert, slot) target: one job per expert from the packed store
        (its record scattered into the component slots), else one per component from
        the safetensors. A packed read that fails or fails its checksum disables the
        packed store and is redone from the safetensors."""
        comps = self.layout.components
        packed = self.store.packed.layer(self.layout.key) if self.store.packed else None
        if packed is not None:
            jobs = [
                (packed.file, packed.offset(e), [self._views[c.name][slot] for c in comps])
                for e, slot in targets
            ]
            try:
                return self.store.read(jobs, packed.check)
            except OSError as e:
                self.store.packed.disable(f"damaged ({' '.join(str(e).split())})")
        jobs = [
            (comp.file, comp.span(e)[0], [self._views[comp.name][slot]])
            for e, slot in targets
            for comp in comps
        ]
        return self.store.read(jobs)

    def remap(self, indices: mx.array) -> mx.array:
        """Expert ids -> slot ids, on the device."""
        if self.identity:
            return indices
        return mx.take(self.device_map, indices)

    def unplaced(self, ids: np.ndarray) -> int:
        """Routes in `ids` whose expert has no slot (counted, and must be 0)."""
        n = int(np.count_nonzero(self.slot_of[ids] < 0))
        self.counters.unplaced += n
        return n

    def bad_slots(self) -> int:
        """Compare every occupied slot with its expert's bytes on disk; count bad slots."""
        self.settle_prefetch()
        bad = 0
        for slot, e in enumerate(self.expert_in):
            if e < 0:
                continue
            for comp in self.layout.components:
                offset, length = comp.span(int(e))
                disk = self.store.read_bytes(comp.file, offset, length)
                if disk != self._views[comp.name][slot].tobytes():
                    bad += 1
                    break
        return bad

    def _resident(self):
        return (int(e) for e in self.expert_in if e >= 0)

    def _publish_map(self) -> None:
        self.device_map = mx.array(np.maximum(self.slot_of, 0))
        self.identity = False


def _wait_out(future) -> None:
    """Wait until `future` is done, through further interrupts: its read writes into
    slots that must not be handed out again before it stops."""
    while not future.done():
        try:
            wait([future])
        except KeyboardInterrupt:
            continue
