"""One loaded model for its whole life: its weights, pools, reader, prompt cache, what its
generations carry, and its residency.

Loading, rebuilding the pools with new sizes or a new policy, and swapping the expert
reader are the provider's; it keeps the dense weights and the prompt cache across
changes that do not need a reload. Every change runs under its lock, so no generation
(and so no expert read) is in flight meanwhile. The engine (engine/manager.py) holds one
provider per loaded model and runs one of them by reference; how a provider loads and
steps its generations is the `Stepping` it is given (a pipeline's: distributed/engine.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .. import values
from ..errors import CheckpointError, one_line
from ..experts.policies import DEFAULT_POLICY, POLICIES
from ..experts.pool import PoolCounters
from . import figures, memory, sharing
from .request import LoadSpec


class EngineError(Exception):
    """A problem the user can fix; the message is one line."""


class LoadError(EngineError):
    """The requested checkpoint could not be loaded."""


@dataclass
class Carried:
    """What one generation of a model leaves for its next."""

    drafters: dict = field(default_factory=dict)  # speculation: the drafter kept between generations
    disk: Any = None  # the conversation cache on disk in use
    disk_key: Any = None  # (spec, checkpoint, KV layout) it was opened for
    warned: set = field(default_factory=set)  # warnings already printed once


class Stepping:
    """How a model loads and steps its generations on one machine; a pipeline gives its
    models another (distributed/engine.py: every rank loads, steps in lockstep)."""

    batches = True  # a stepping that runs each generation alone (a pipeline's) says False

    def load(self, provider: "ModelProvider", spec: LoadSpec) -> None:
        provider.load(spec.path, expert_slots=spec.expert_slots, policy=spec.policy, threads=spec.threads,
                      page_cache=spec.page_cache, packed=spec.packed, overlap=spec.overlap,
                      buffer_cache=spec.buffer_cache)

    def steps(self, responses):
        """The responses of one generation as respond() reads them."""
        return responses

    def between_chunks(self, out, last: bool) -> None:
        """After each prefill call (`last`: the one that ends with the first token): a
        generation whose caller has gone, or an exit, stops here."""
        out.check_cancelled()

    def between_groups(self, out) -> None:
        """After each tile and expert group of a prefill's call (engine/prefill.py), which
        on a long prompt can run for minutes: a generation whose caller has gone stops."""
        out.check_cancelled()


class ModelProvider:
    """One loaded model: its pools, its reader, its prompt cache, what its generations
    carry (`carried`), and, held by an engine, its residency (`spec`, `used`)."""

    def __init__(self, stepping: Optional[Stepping] = None) -> None:
        self.stepping = stepping or Stepping()
        self.carried = Carried()
        self.spec: Optional[LoadSpec] = None  # held by an engine: as last asked for
        self.used = 0.0  # held by an engine: time.monotonic() of its last request
        self.state = "empty"  # empty | loading | loaded | error
        self.error: str | None = None
        self.loaded = None  # StreamingModel
        self.prompts = None  # engine/prompt_cache.PromptCache: every conversation and snapshot of the model
        self.expert_slots: int | list[int] | None = None
        self.policy = DEFAULT_POLICY
        self.threads: int | None = None  # expert reader threads
        self.page_cache: str | None = None  # "keep" | "bypass"
        self.packed: bool | None = None  # use the checkpoint's packed store when valid
        self.overlap = "auto"  # reads overlapping compute, read-ahead (experts/prefetch.py)
        self.buffer_cache: int | None = None  # bytes of freed buffers MLX may keep (engine/memory.py)
        self._retired = PoolCounters()  # counters of pools replaced by a rebuild
        self._parts: tuple = ((), (0, 0, 0))  # (its pools' ids, memory_parts()) as last worked out
        self._lock = threading.RLock()
        self.prepare = None  # load_streaming's `prepare` (a pipeline rank's layer range)

    @property
    def checkpoint(self) -> Path | None:
        return self.loaded.path if self.loaded else None

    @property
    def tokenizer(self):
        return self.loaded.tokenizer if self.loaded else None

    @property
    def config(self) -> dict | None:
        return self.loaded.config if self.loaded else None

    @property
    def context_length(self) -> int | None:
        config = self.config or {}
        text = config.get("text_config", {})
        return config.get("max_position_embeddings") or text.get("max_position_embeddings")

    def load(self, path, *, expert_slots: int | list[int] | None = None, policy: str = DEFAULT_POLICY,
             threads: int | None = None, page_cache: str | None = None, packed: bool | None = None,
             overlap: str | None = None, buffer_cache: int | None = None) -> None:
        """Load `path` (a no-op if loaded); new pool settings rebuild only the pools.

        `threads` (reader threads), `page_cache` ("keep" or "bypass"), `overlap`
        ("auto", "on", "off") and `buffer_cache` (bytes) apply to a loaded model without
        reloading; `packed` (use the checkpoint's packed store when present and valid)
        reloads it when it changes. None means the loader's default.
        """
        _check_params(expert_slots, policy)
        io = _io_params(threads, page_cache, packed)
        overlap = _overlap_mode(overlap)
        path = Path(path).expanduser().resolve()
        with self._lock:
            self._cap_buffers(memory.DEFAULT_BUFFER_CACHE if buffer_cache is None else buffer_cache)
            if self.state == "loaded" and self.checkpoint == path:
                if io["packed"] == self.packed:
                    self.configure(expert_slots=expert_slots, policy=policy, overlap=overlap,
                                   threads=io["threads"], page_cache=io["page_cache"])
                    return
            self.unload()
            self.state, self.error = "loading", None
            from .loading import load_streaming

            try:
                self.loaded = load_streaming(path, expert_slots=expert_slots, policy=policy,
                                             overlap=overlap, prepare=self.prepare, **io)
            except (CheckpointError, ValueError, OSError) as e:
                self.state, self.error = "error", one_line(e)
                raise EngineError(self.error) from None
            except BaseException as e:
                self.state, self.error = "error", one_line(e)
                raise
            from .prompt_cache import PromptCache

            self.prompts = PromptCache(self.loaded.model, self.loaded.config)
            self.expert_slots, self.policy = expert_slots, policy
            self.threads, self.page_cache = io["threads"], io["page_cache"]
            self.packed, self.overlap = io["packed"], overlap
            self.state = "loaded"

    def load_spec(self, spec: LoadSpec) -> None:
        """Load (or rebuild) as `spec` asks, the way its stepping loads; a failure is a LoadError."""
        try:
            self.stepping.load(self, spec)
        except EngineError as e:
            raise LoadError(str(e)) from None

    def configure(self, *, expert_slots: int | list[int] | None = None, policy: str | None = None,
                  threads: int | None = None, page_cache: str | None = None,
                  overlap: str | None = None) -> None:
        """Change pool size or policy at run time, keeping the dense weights; change the
        reader threads, page-cache mode or overlap (None: unchanged) without touching
        the pools."""
        policy = policy or self.policy
        _check_params(expert_slots, policy)
        threads = self.threads if threads is None else threads
        page_cache = self.page_cache if page_cache is None else page_cache
        _io_params(threads, page_cache, None)
        overlap = self.overlap if overlap is None else _overlap_mode(overlap)
        with self._lock:
            if overlap != self.overlap:
                self.require_loaded()
                self.loaded.overlap.mode = self.overlap = overlap
            if (threads, page_cache) != (self.threads, self.page_cache):
                self.require_loaded()
                self._replace_store(threads, page_cache)
            if (expert_slots, policy) == (self.expert_slots, self.policy):
                return
            self.require_loaded()
            for pool in self.loaded.all_pools:
                self._retired.add(pool.counters)
            self.loaded.build_pools(expert_slots, policy)
            self.expert_slots, self.policy = expert_slots, policy

    def _cap_buffers(self, limit: int) -> None:
        if limit != self.buffer_cache:
            memory.cap_buffer_cache(limit)
            self.buffer_cache = limit

    def _replace_store(self, threads: int, page_cache: str) -> None:
        """A new reader (threads, page-cache mode) for every pool; the slots stay as they are."""
        from ..experts.store import ExpertStore

        old = self.loaded.store
        for pool in self.loaded.all_pools:
            pool.settle_prefetch()  # no read ahead may still run on the old reader
        new = ExpertStore(threads, page_cache)
        new.packed = getattr(old, "packed", None)
        new.adopt(old)  # the files the model was loaded from, even if replaced since
        self.loaded.store = new
        for pool in self.loaded.all_pools:
            pool.store = new
        old.close()
        self.threads, self.page_cache = threads, page_cache

    def unload(self) -> None:
        """Unload its model: the pools settle, the reader closes, and what its generations
        carried (a drafter's weights, the conversation cache it had open) goes with it."""
        with self._lock:
            if self.loaded is not None:
                for pool in self.loaded.all_pools:
                    if pool is not None:
                        pool.settle_prefetch()
                self.loaded.store.close()
            self.loaded = self.prompts = None
            self._retired = PoolCounters()
            self.carried = Carried(warned=self.carried.warned)
            self.state, self.error = "empty", None

    def require_loaded(self) -> None:
        if self.state != "loaded":
            raise EngineError(self.error or "no model is loaded")

    # -- its residency in an engine (engine/residents.py) -------------------------------
    def held_bytes(self) -> Optional[int]:
        """Bytes it holds by its footprint and the slots it has now (None: not budgeted)."""
        footprint = self.spec.footprint if self.spec is not None else None
        if footprint is None:
            return None
        return footprint.fixed_bytes + sharing.pool_bytes(footprint, sharing.wanted_slots(footprint, self.expert_slots))

    # -- what the pools hold and did -------------------------------------------------
    def slots_per_layer(self) -> int | list[int] | None:
        """Slots per MoE layer: one number when every layer has the same."""
        return figures.slots_per_layer(self.loaded)

    def counters(self) -> PoolCounters:
        """Counters summed over every layer (and an MTP head's pool), including pools
        replaced by rebuilds."""
        return figures.pool_counters(self.loaded, self._retired)

    def memory_parts(self) -> tuple[int, int, int]:
        """(bytes beside its pools, bytes of its pools, slots over every pool), worked out
        again only after a load or a pool rebuild (call it on the engine thread)."""
        if self.loaded is None:
            return 0, 0, 0
        pools = [p for p in self.loaded.all_pools if p is not None]
        key = tuple(id(p) for p in pools)
        if self._parts[0] != key:
            from mlx.utils import tree_flatten

            params = sum(v.nbytes for _, v in tree_flatten(self.loaded.model.parameters()))
            in_model = sum(a.nbytes for p in self.loaded.pools if p is not None for a in p.arrays.values())
            pooled = sum(a.nbytes for p in pools for a in p.arrays.values())
            self._parts = (key, (params - in_model, pooled, sum(p.slots for p in pools)))
        return self._parts[1]

    def bad_slots(self) -> int:
        """Bad slots over every pool (0 when every resident expert matches the disk)."""
        with self._lock:
            self.require_loaded()
            return sum(pool.bad_slots() for pool in self.loaded.all_pools)


def _check_params(expert_slots, policy) -> None:
    counts = expert_slots if isinstance(expert_slots, (list, tuple)) else [expert_slots]
    with _as_engine_error():
        for n in counts:
            if n is not None:
                values.at_least_one("expert_slots", n)
        values.one_of("policy", policy, POLICIES)


def _io_params(threads, page_cache, packed) -> dict:
    """The read settings with the loader's defaults filled in; a bad one is an EngineError."""
    from ..experts.store import DEFAULT_THREADS

    threads = DEFAULT_THREADS if threads is None else threads
    page_cache = page_cache or "keep"
    with _as_engine_error():
        values.at_least_one("threads", threads)
        values.one_of("page_cache", page_cache, values.PAGE_CACHE_MODES)
    return {"threads": threads, "page_cache": page_cache, "packed": True if packed is None else bool(packed)}


def _overlap_mode(overlap) -> str:
    """`overlap` with the loader's default filled in; a bad one is an EngineError."""
    overlap = overlap or "auto"
    with _as_engine_error():
        values.one_of("overlap", overlap, values.OVERLAP_MODES)
    return overlap


@contextmanager
def _as_engine_error():
    try:
        yield
    except ValueError as e:
        raise EngineError(str(e)) from None
