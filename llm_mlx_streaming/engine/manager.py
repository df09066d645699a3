"""The process-wide engine: one loaded model, one generation at a time, live settings.

`llm chat` and Python code that keep a conversation hold on to the same manager, so
the dense weights, the expert pools and the KV cache survive between turns.

Every generation runs on one engine thread, as one operation under the engine lock:
load the request's checkpoint if it is not loaded, render its prompt with that
model's tokenizer, generate. Callers, whichever thread or server request they come
from, queue their requests and read the responses from their own `Generation`, so a
response always runs on, and reports, the checkpoint it asked for, and a caller that
stops reading never blocks the others.
"""

from __future__ import annotations

import queue
import resource
import sys
import threading
import time
from dataclasses import fields, replace
from pathlib import Path

from ..errors import CheckpointError, one_line
from ..experts.pool import PoolCounters
from ..experts.policies import DEFAULT_POLICY, POLICIES
from .generation import Cancelled, Channel, Generation, Started
from ..processors import with_history
from .request import LoadSpec, Request
from ..stops import StopMatcher


class EngineError(Exception):
    """A problem the user can fix; the message is one line."""


class LoadError(EngineError):
    """The requested checkpoint could not be loaded."""


def peak_rss_bytes() -> int:
    """Peak resident set size: ru_maxrss is bytes on macOS, KiB on Linux."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


class EngineManager:
    """Load state, the generation lock, runtime parameters and metrics."""

    def __init__(self) -> None:
        self.state = "empty"  # empty | loading | loaded | error
        self.error: str | None = None
        self.loaded = None  # StreamingModel
        self.session = None
        self.expert_slots: int | list[int] | None = None
        self.policy = DEFAULT_POLICY
        self.threads: int | None = None  # expert reader threads
        self.page_cache: str | None = None  # "keep" | "bypass"
        self.packed: bool | None = None  # use the checkpoint's packed store when valid
        self.max_tokens = 256  # when a request names none
        self.last_stats: dict | None = None
        self.last_decode_tps: float | None = None
        self.served = 0  # generations run to the end
        self.queued = 0  # requests waiting for the engine thread
        self._retired = PoolCounters()  # counters of pools replaced by a rebuild
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self._warned: set[str] = set()  # warnings already printed once
        self._disk = self._disk_key = None  # the conversation cache on disk in use
        self._disk_loaded = 0  # tokens the current request took from it
        self.drafters: dict = {}  # speculation: the drafter kept between generations

    # -- loading -----------------------------------------------------------------
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
             threads: int | None = None, page_cache: str | None = None, packed: bool | None = None) -> None:
        """Load `path` (a no-op if loaded); new pool settings rebuild only the pools.

        `threads` (reader threads) and `page_cache` ("keep" or "bypass") apply to a loaded
        model without reloading; `packed` (use the checkpoint's packed store when present
        and valid) reloads it when it changes. None means the loader's default.
        """
        _check_params(expert_slots, policy)
        io = _io_params(threads, page_cache, packed)
        path = Path(path).expanduser().resolve()
        with self._lock:
            if self.state == "loaded" and self.checkpoint == path:
                if io["packed"] == self.packed:
                    self.configure(expert_slots=expert_slots, policy=policy,
                                   threads=io["threads"], page_cache=io["page_cache"])
                    return
            self.unload()
            self.state, self.error = "loading", None
            from .loading import load_streaming

            try:
                self.loaded = load_streaming(path, expert_slots=expert_slots, policy=policy, **io)
            except (CheckpointError, ValueError, OSError) as e:
                self.state, self.error = "error", one_line(e)
                raise EngineError(self.error) from None
            except BaseException as e:
                self.state, self.error = "error", one_line(e)
                raise
            from .session import Session

            self.session = Session(self.loaded.model)
            _limit_buffer_cache(self.loaded)
            self.expert_slots, self.policy = expert_slots, policy
            self.threads, self.page_cache = io["threads"], io["page_cache"]
            self.packed = io["packed"]
            self.state = "loaded"

    def _load_spec(self, spec: LoadSpec) -> None:
        self.load(spec.path, expert_slots=spec.expert_slots, policy=spec.policy,
                  threads=spec.threads, page_cache=spec.page_cache, packed=spec.packed)

    def configure(self, *, expert_slots: int | list[int] | None = None, policy: str | None = None,
                  threads: int | None = None, page_cache: str | None = None) -> None:
        """Change pool size or policy at run time, keeping the dense weights; change the
        reader threads or page-cache mode (None: unchanged) without touching the pools."""
        policy = policy or self.policy
        _check_params(expert_slots, policy)
        threads = self.threads if threads is None else threads
        page_cache = self.page_cache if page_cache is None else page_cache
        _io_params(threads, page_cache, None)
        with self._lock:
            if (threads, page_cache) != (self.threads, self.page_cache):
                self._require_loaded()
                self._replace_store(threads, page_cache)
            if (expert_slots, policy) == (self.expert_slots, self.policy):
                return
            self._require_loaded()
            for pool in self.loaded.all_pools:
                self._retired.add(pool.counters)
            self.loaded.build_pools(expert_slots, policy)
            self.expert_slots, self.policy = expert_slots, policy

    def _replace_store(self, threads: int, page_cache: str) -> None:
        """A new reader (threads, page-cache mode) for every pool; the slots stay as they are.

        Called under the lock, so no generation, and so no read, is in flight.
        """
        from ..experts.store import ExpertStore

        old = self.loaded.store
        new = ExpertStore(threads, page_cache)
        new.packed = getattr(old, "packed", None)
        new.adopt(old)  # the files the model was loaded from, even if replaced since
        self.loaded.store = new
        for pool in self.loaded.all_pools:
            pool.store = new
        old.close()
        self.threads, self.page_cache = threads, page_cache

    def unload(self) -> None:
        with self._lock:
            if self.loaded is not None:
                self.loaded.store.close()
            self.loaded = self.session = None
            self._retired = PoolCounters()
            self.state, self.error = "empty", None

    def _require_loaded(self) -> None:
        if self.state != "loaded":
            raise EngineError(self.error or "no model is loaded")

    # -- generation --------------------------------------------------------------
    def run(self, load: LoadSpec | None, request: Request) -> Generation:
        """Queue "load `load` if needed (None: whatever is loaded), then generate `request`".

        Returns at once; the handle yields mlx-lm GenerationResponses as the engine
        thread produces them, raises what the load, the prompt or the generation raised,
        and then holds the figures in `stats`. Requests run one at a time, in order.
        """
        generation = Generation()
        with self._count_lock:
            self.queued += 1
        channel = generation.channel  # the engine thread gets the channel, never the handle
        _engine_thread().submit(lambda: self._serve(load, request, channel), channel)
        return generation

    def generate(self, prompt_tokens: list[int], *, max_tokens: int | None = None, sampler=None,
                 logits_processors=None, max_context: int | None = None, trace_path=None) -> Generation:
        """Generate from token ids on the loaded model (see `run`)."""
        return self.run(None, Request(prompt=list(prompt_tokens), max_tokens=max_tokens, sampler=sampler,
                                      logits_processors=list(logits_processors or []),
                                      max_context=max_context, trace_path=trace_path))

    # -- load or rebuild the pools without generating ---------------------
    def queue_load(self, load: LoadSpec) -> Generation:
        """Queue "load `load` if needed" on its own (a server's warm start, a pool
        rebuild), in turn with the generations; iterating the handle waits for it,
        raises what the load raised and then ends."""
        generation = Generation()
        channel = generation.channel

        def job():
            with self._lock:
                channel.check_cancelled()
                try:
                    self._load_spec(load)
                except EngineError as e:
                    raise LoadError(str(e)) from None
            channel.put("done", None)

        _engine_thread().submit(job, channel)
        return generation

    def _serve(self, load: LoadSpec | None, request: Request, out: Channel) -> None:
        """One request, on the engine thread, under the lock."""
        with self._count_lock:
            self.queued -= 1
        with self._lock:
            out.check_cancelled()
            if load is not None:
                try:
                    self._load_spec(load)
                except EngineError as e:
                    raise LoadError(str(e)) from None
            self._require_loaded()
            tokenizer = self.loaded.tokenizer
            prompt = request.prompt(tokenizer) if callable(request.prompt) else request.prompt
            prompt = [int(t) for t in prompt]
            max_tokens = self._token_budget(prompt, request)
            for processor in request.logits_processors:  # constrained decoding closes within it
                if hasattr(processor, "limit_tokens"):
                    processor.limit_tokens(max_tokens)
            kv, kv_note = self._kv_layout(request.kv)
            cache, new_tokens, reused = self.session.reuse_for(prompt, kv)
            cache, new_tokens, reused = self._from_disk(request, prompt, kv, cache, new_tokens, reused)
            out.put("started", Started(tokenizer, self.checkpoint, prompt, reused))
            self._generate(request, out, cache, prompt, new_tokens, reused, max_tokens, kv, kv_note)

    # -- the conversation cache on disk (engine/disk_cache.py) -----
    def _disk_cache(self, request: Request, kv):
        """The conversation cache for this request's checkpoint and KV layout, or None."""
        spec = request.conversation_cache
        if spec is None:  # this turn changes the session's cache unseen: a later one writes it whole
            self._disk = self._disk_key = None
            return None
        from .disk_cache import DiskCache, namespace

        key = (spec, str(self.checkpoint), kv)
        if self._disk_key != key:  # the namespace reads the checkpoint's fingerprint
            self._disk, self._disk_key = DiskCache(spec, namespace(self.checkpoint, kv)), key
        return self._disk

    def _from_disk(self, request: Request, prompt, kv, cache, new_tokens, reused):
        """A longer prefix than the session holds, from disk, when there is one."""
        self._disk_loaded = 0
        disk = self._disk_cache(request, kv)
        if disk is None or reused >= len(prompt) - 1:
            return cache, new_tokens, reused
        from .kv import make_cache

        found = disk.lookup(prompt, reused, make_cache(self.loaded.model, kv))
        if found is None:
            return cache, new_tokens, reused
        self.session.adopt(found.cache, found.tokens, kv)
        cache, new_tokens, reused = self.session.reuse_for(prompt, kv)
        self._disk_loaded = reused
        return cache, new_tokens, reused

    def _save_to_disk(self, request: Request, kv, stats: dict) -> None:
        """Save the session's cache for a later process; a failed write is a warning
        and a figure, never a lost reply."""
        disk = self._disk_cache(request, kv)
        stats["disk_cache_tokens"] = self._disk_loaded
        if disk is None or not self.session.tokens:
            return
        try:
            stats["disk_cache_saved_bytes"] = disk.save(self.session.cache, self.session.tokens, stats["reused_tokens"])
        except Exception as e:  # OSError, a cache class save_prompt_cache cannot write
            stats["disk_cache_error"] = one_line(e)
            if "disk_cache" not in self._warned:
                self._warned.add("disk_cache")
                print(f"mlx-stream: warning: conversation cache not saved: {one_line(e)}", file=sys.stderr)

    # -- long context (engine/kv.py) ---------------------------------------------
    def _kv_layout(self, spec):
        """(the KV layout the loaded model runs `spec` with, a note when it differs);
        a layout the model cannot take is an EngineError."""
        from mlx.utils import tree_flatten

        from .kv import KVError, resolve

        try:
            return resolve(spec, self.loaded.config, (n for n, _ in tree_flatten(self.loaded.model.parameters())))
        except KVError as e:
            raise EngineError(str(e)) from None

    @staticmethod
    def _kv_figures(cache, kv, kv_note, prefill_step: int, ttft: float | None) -> dict:
        from .kv import bits_in_use, cache_bytes, kept_note

        figures = {
            "kv_bits": bits_in_use(cache),
            "kv_bytes": cache_bytes(cache),
            "prefill_step": prefill_step,
            "ttft_seconds": round(ttft, 4) if ttft is not None else None,
        }
        if kv.quantized:
            figures.update(kv_group_size=kv.group_size, kv_start=kv.start)
            kv_note = kv_note or kept_note(cache)
        if kv_note:
            figures["kv_note"] = kv_note
        return figures

    def _token_budget(self, prompt: list[int], request: Request) -> int:
        """Tokens this request may generate; a prompt that cannot fit is an EngineError."""
        max_tokens = self.max_tokens if request.max_tokens is None else request.max_tokens
        limit = self.context_length
        if request.max_context and (not limit or request.max_context < limit):
            limit = request.max_context
            what = f"the max_context of {limit} tokens (raise it with `llm mlxs config max_context N`)"
        else:
            what = f"the model's context of {limit} tokens"
        if not prompt:
            raise EngineError("the prompt is empty")
        if limit and len(prompt) + 1 > limit:
            raise EngineError(f"the prompt is {len(prompt)} tokens, longer than {what}")
        if max_tokens < 1:  # unlimited: until the context is full
            if not limit:
                raise EngineError("max_tokens is unlimited, but the model declares no context length")
            return limit - len(prompt)
        return min(max_tokens, limit - len(prompt)) if limit else max_tokens

    def _generate(self, request: Request, out: Channel, cache, prompt, new_tokens, reused, max_tokens,
                  kv, kv_note) -> None:
        import mlx.core as mx
        from mlx_lm.generate import stream_generate

        from .planner import PREFILL_STEP

        prefill_step = request.prefill_step or PREFILL_STEP
        # -- k > 0 runs the draft-and-verify loop -------------
        from ..speculation import start as spec

        try:
            figures = spec.figures_for(request)
            run = None
            if figures.k != 0:
                figures.speculation_off = spec.off_reason(request)
                if figures.speculation_off is None:
                    run = spec.make_run(request, self.loaded, cache, prompt[:reused], new_tokens,
                                        max_tokens, self.drafters, figures,
                                        prefill_step=prefill_step, kv_kwargs=kv.generate_kwargs())
        except (ValueError, spec.DraftError) as e:
            raise EngineError(one_line(e)) from None
        before = self.counters()
        mx.reset_peak_memory()
        start = time.perf_counter()
        ttft = None
        last = None
        generated: list[int] = []
        recorder = self._recorder(request.trace_path)
        stops = StopMatcher(request.stop)
        if run is not None:
            from ..speculation.decode import stream_speculative

            responses = stream_speculative(run, self.loaded.tokenizer)
        else:
            responses = stream_generate(
                self.loaded.model, self.loaded.tokenizer, new_tokens,
                max_tokens=max_tokens, sampler=request.make_sampler(),
                logits_processors=with_history(request.logits_processors, prompt[:reused]) or None,
                prompt_cache=cache,
                prefill_step_size=prefill_step, **kv.generate_kwargs(),
            )
        try:
            for response in responses:
                if ttft is None:
                    ttft = time.perf_counter() - start
                out.check_cancelled()
                generated.append(response.token)
                text = stops.feed(response.text)
                if stops.hit is not None:
                    response = replace(response, text=text, finish_reason="stop")
                elif response.finish_reason is not None:
                    response = replace(response, text=text + stops.flush())
                elif text != response.text:
                    response = replace(response, text=text)
                last = response
                out.put("response", response)
                if stops.hit is not None:
                    break
        except BaseException:
            self.session.reset()  # the cache may hold a half-fed step
            raise
        finally:
            mx.synchronize()  # nothing may still read a slot when the pools change
            if recorder is not None:
                recorder.__exit__(None, None, None)
        if run is not None:
            self.session.fed(run.fed)  # the drafts it rejected were rolled back
        else:
            self.session.fed(new_tokens)
            self.session.fed(generated)
        stats = self._stats(before, last, len(prompt), reused, len(new_tokens), time.perf_counter() - start)
        stats.update(figures.as_dict())
        stats.update(self._kv_figures(self.session.cache, kv, kv_note, prefill_step, ttft))
        if recorder is not None:
            self._write_trace(recorder, request.trace_path, stats)
        self._save_to_disk(request, kv, stats)
        self.last_stats, self.last_decode_tps = stats, stats["decode_tps"]
        self.served += 1
        out.put("done", stats)

    def _write_trace(self, recorder, path: Path, stats: dict) -> None:
        """Telemetry never fails a response: a trace that cannot be written is a warning
        (once per path) and a `trace_error` figure."""
        try:
            recorder.write(path, self.checkpoint.name)
        except OSError as e:
            stats["trace_error"] = one_line(e)
            if str(path) not in self._warned:
                self._warned.add(str(path))
                print(f"mlx-stream: warning: routing trace not written: {one_line(e)}", file=sys.stderr)

    def _recorder(self, trace_path):
        if trace_path is None or not self.loaded.layers:
            return None
        from .trace import TraceRecorder

        return TraceRecorder(self.loaded.layers, self.loaded.layers[0].layout.num_experts).__enter__()

    def _stats(self, before: PoolCounters, last, prompt: int, reused: int, prefilled: int, seconds: float) -> dict:
        import mlx.core as mx

        now = self.counters()
        delta = {f.name: getattr(now, f.name) - getattr(before, f.name) for f in fields(PoolCounters)}
        lookups = delta["hits"] + delta["misses"]
        generated = last.generation_tokens if last else 0
        return {
            "prompt_tokens": prompt,
            "reused_tokens": reused,
            "prefilled_tokens": prefilled,
            "generated_tokens": generated,
            "prefill_tps": round(last.prompt_tps, 2) if last else None,
            "decode_tps": round(last.generation_tps, 2) if last else None,
            "seconds": round(seconds, 3),
            "hits": delta["hits"],
            "misses": delta["misses"],
            "hit_rate": round(delta["hits"] / lookups, 4) if lookups else None,
            "evictions": delta["evictions"],
            "mb_read": round(delta["bytes_read"] / 1e6, 3),
            "read_seconds": round(delta["read_seconds"], 4),
            "reads": delta["reads"],
            "read_mb_per_s": round(delta["bytes_read"] / delta["read_seconds"] / 1e6, 1)
            if delta["read_seconds"] else None,
            "unplaced": delta["unplaced"],
            "calls_no_load": delta["calls_no_load"],
            "calls_loaded": delta["calls_loaded"],
            "overlapped": delta["overlapped"],
            "peak_memory_bytes": int(mx.get_peak_memory()),
            "expert_slots": self.slots_per_layer(),
            "policy": self.policy,
            "store": store_in_use(self.loaded),
            "threads": self.threads,
            "page_cache": self.page_cache,
            "checkpoint": str(self.checkpoint),
            "finish_reason": last.finish_reason if last else None,
        }

    # -- metrics -----------------------------------------------------------------
    def slots_per_layer(self) -> int | list[int] | None:
        """Slots per MoE layer: one number when every layer has the same."""
        # (a pool being rebuilt is None for a moment; the server reads this meanwhile)
        slots = [pool.slots for pool in (self.loaded.pools if self.loaded else []) if pool is not None]
        if not slots:
            return None
        return slots[0] if len(set(slots)) == 1 else slots

    def counters(self) -> PoolCounters:
        """Counters summed over every layer (and an MTP head's pool), including pools
        replaced by rebuilds."""
        total = PoolCounters()
        total.add(self._retired)
        for pool in self.loaded.all_pools if self.loaded else []:
            if pool is not None:  # None while it is being rebuilt
                total.add(pool.counters)
        return total

    def bad_slots(self) -> int:
        """Bad slots over every pool (0 when every resident expert matches the disk)."""
        with self._lock:
            self._require_loaded()
            return sum(pool.bad_slots() for pool in self.loaded.all_pools)

    def metrics(self) -> dict:
        import mlx.core as mx

        counters = self.counters().as_dict()
        return {
            "state": self.state,
            "error": self.error,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "expert_slots": self.slots_per_layer(),
            "policy": self.policy,
            "threads": self.threads,
            "page_cache": self.page_cache,
            "store": store_in_use(self.loaded),
            "max_tokens": self.max_tokens,
            "peak_rss_bytes": peak_rss_bytes(),
            "mlx_active_memory_bytes": int(mx.get_active_memory()),
            "mlx_peak_memory_bytes": int(mx.get_peak_memory()),
            "last_decode_tps": self.last_decode_tps,
            "requests_served": self.served,
            "requests_queued": self.queued,
            **counters,
        }


def _limit_buffer_cache(loaded) -> None:
    """Cap MLX's cache of freed buffers so long sessions do not grow.

    Prefill and expert-major calls free many activation-sized buffers; MLX keeps them
    for reuse, by default without bound. A quarter of the resident weights (at least
    256 MiB) is plenty for reuse. The Metal wired limit needs nothing here: mlx-lm's
    `stream_generate` raises it to cover the model's arrays, pools included, and does
    nothing where there is no Metal.
    """
    import mlx.core as mx
    from mlx.utils import tree_reduce

    resident = tree_reduce(lambda acc, x: acc + x.nbytes, loaded.model.parameters(), 0)
    mx.set_cache_limit(max(256 * 2**20, resident // 4))


def _check_params(expert_slots, policy) -> None:
    counts = expert_slots if isinstance(expert_slots, (list, tuple)) else [expert_slots]
    for n in counts:
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise EngineError(f"expert_slots must be an integer of at least 1, got {n!r}")
    if policy not in POLICIES:
        raise EngineError(f"unknown policy {policy!r}: choose one of {', '.join(sorted(POLICIES))}")


def _io_params(threads, page_cache, packed) -> dict:
    """The read settings with the loader's defaults filled in; a bad one is an EngineError."""
    from ..experts.store import DEFAULT_THREADS, check_page_cache

    threads = DEFAULT_THREADS if threads is None else threads
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise EngineError(f"threads must be an integer of at least 1, got {threads!r}")
    page_cache = page_cache or "keep"
    try:
        check_page_cache(page_cache)
    except ValueError as e:
        raise EngineError(str(e)) from None
    return {"threads": threads, "page_cache": page_cache, "packed": True if packed is None else bool(packed)}


def store_in_use(loaded) -> str | None:
    """Which copy of the experts reads come from: "packed", "safetensors" (None: no model)."""
    if loaded is None:
        return None
    packed = getattr(loaded.store, "packed", None)
    return "packed" if packed is not None and not getattr(packed, "disabled", None) else "safetensors"


class _EngineThread:
    """The one thread that runs every generation in the process, in submission order.

    One thread, because MLX computes one thing at a time anyway and the CPU backend's
    side stream belongs to the thread that made it; a job never waits on another job.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="mlx-stream-engine", daemon=True).start()

    def submit(self, job, channel: Channel) -> None:
        self._jobs.put((job, channel))

    def _loop(self) -> None:
        while True:
            job, channel = self._jobs.get()
            channel.running.set()
            try:
                job()
            except Cancelled:
                pass  # the caller has gone
            except BaseException as e:  # the caller re-raises it, KeyboardInterrupt included
                channel.put("error", e)
            finally:
                channel.finished.set()
                del job, channel


_thread: _EngineThread | None = None
_thread_lock = threading.Lock()


def _engine_thread() -> _EngineThread:
    global _thread
    with _thread_lock:
        if _thread is None:
            _thread = _EngineThread()
        return _thread


_manager: EngineManager | None = None
_manager_lock = threading.Lock()


def get_manager() -> EngineManager:
    """The process-wide engine."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = EngineManager()
        return _manager
