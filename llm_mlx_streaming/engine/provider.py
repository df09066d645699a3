"""The model provider: which checkpoint is loaded, and how its experts are pooled and read.

Loading, rebuilding the pools with new sizes or a new policy, and swapping the expert
reader are the provider's; it keeps the dense weights and the prompt cache across
changes that do not need a reload. Every change runs under its lock, so no generation
(and so no expert read) is in flight meanwhile.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

from .. import values
from ..errors import CheckpointError, one_line
from ..experts.policies import DEFAULT_POLICY, POLICIES
from ..experts.pool import PoolCounters
from . import figures, memory
from .request import LoadSpec


class EngineError(Exception):
    """A problem the user can fix; the message is one line."""


class LoadError(EngineError):
    """The requested checkpoint could not be loaded."""


class ModelProvider:
    """The loaded model, its pools, its reader and its prompt cache."""

    def __init__(self) -> None:
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
            self.drop_running()
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
        """`load` for a request's LoadSpec; a failure is a LoadError."""
        try:
            self.load(spec.path, expert_slots=spec.expert_slots, policy=spec.policy,
                      threads=spec.threads, page_cache=spec.page_cache, packed=spec.packed,
                      overlap=spec.overlap, buffer_cache=spec.buffer_cache)
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
        """Unload everything this provider holds."""
        self.drop_running()

    def drop_running(self) -> None:
        """Unload the model it runs (an engine keeps its other loaded models)."""
        with self._lock:
            if self.loaded is not None:
                for pool in self.loaded.all_pools:
                    if pool is not None:
                        pool.settle_prefetch()
                self.loaded.store.close()
            self.loaded = self.prompts = None
            self._retired = PoolCounters()
            self.state, self.error = "empty", None

    def require_loaded(self) -> None:
        if self.state != "loaded":
            raise EngineError(self.error or "no model is loaded")

    batches = True  # a provider that steps its generations itself (a pipeline rank) runs them alone

    def steps(self, responses):
        """The responses of one generation as respond() reads them; a pipeline rank
        wraps them to step in lockstep with the other ranks."""
        return responses

    def between_chunks(self, out, last: bool) -> None:
        """After each prefill chunk (`last`: the one that ends with the first token): a
        generation whose caller has gone, or an exit, stops here; a pipeline rank hears
        rank 0's word instead, so every rank stops at the same chunk."""
        out.check_cancelled()

    # -- what the pools hold and did -------------------------------------------------
    def slots_per_layer(self) -> int | list[int] | None:
        """Slots per MoE layer: one number when every layer has the same."""
        return figures.slots_per_layer(self.loaded)

    def counters(self) -> PoolCounters:
        """Counters summed over every layer (and an MTP head's pool), including pools
        replaced by rebuilds."""
        return figures.pool_counters(self.loaded, self._retired)

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
