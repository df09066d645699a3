"""The process-wide engine: its loaded models, one generation at a time, live settings.

`llm chat` and Python code that keep a conversation hold on to the same manager, so
the dense weights, the expert pools and the KV cache survive between turns. Each loaded
model is one ModelProvider for its whole life (engine/provider.py); the manager holds
them under one memory budget (engine/residents.py) and runs one of them by reference.
Every load and generation runs on the engine thread (engine/worker.py) as one operation
under the manager's lock: load the request's checkpoint if it is not loaded, then
generate (engine/respond.py). So a response always runs on, and reports, the checkpoint
it asked for.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from .. import syncs
from . import figures, worker
from ..activity import ACTIVITY
from ..experts.pool import PoolCounters
from .generation import Channel, Generation, Started
from .provider import EngineError, ModelProvider, Stepping
from .request import LoadSpec, Request
from .residents import Limits, Residency, Residents
from .batch import Batch, admit_or_refuse, alone_reason
from .respond import respond


class EngineManager:
    """The loaded models and the one that runs, the queue to the engine thread, and
    what it served."""

    def __init__(self, stepping: Optional[Stepping] = None) -> None:
        self.stepping = stepping or Stepping()  # given to each model it loads
        self.max_tokens = 256  # when a request names none
        self.last_stats: dict | None = None
        self.last_decode_tps: float | None = None
        self.served = 0  # generations run to the end
        self.queued = 0  # requests waiting for the engine thread
        self.generated = 0  # tokens generated, over every response
        self.syncs_at_start = syncs.count()  # engine figures count host syncs from here
        self.batch = 0  # requests in the running batch (engine/batch.py)
        self.largest_batch = 0
        self._count_lock = threading.Lock()
        self._lock = threading.RLock()
        self.residents = Residents()

    # -- the model that runs, read through ---------------------------------------------
    @property
    def running(self) -> Optional[ModelProvider]:
        return self.residents.running

    @property
    def loaded(self):
        """The running model's StreamingModel (None: none runs)."""
        return self.running.loaded if self.running is not None else None

    @property
    def prompts(self):
        """The running model's prompt cache (None: none runs)."""
        return self.running.prompts if self.running is not None else None

    @property
    def checkpoint(self) -> Optional[Path]:
        return self.running.checkpoint if self.running is not None else None

    @property
    def tokenizer(self):
        return self.running.tokenizer if self.running is not None else None

    @property
    def state(self) -> str:
        """empty | loading | loaded | error: the engine's latest load."""
        return self.residents.shown.state

    @property
    def error(self) -> Optional[str]:
        return self.residents.shown.error

    def counters(self) -> PoolCounters:
        """The running model's pool counters since its load."""
        return self.running.counters() if self.running is not None else PoolCounters()

    def require_running(self) -> ModelProvider:
        if self.running is None:
            raise EngineError(self.error or "no model is loaded")
        return self.running

    # -- loading, changing, unloading (on the calling thread, under the lock) ----------
    def load(self, path, **settings) -> ModelProvider:
        """Run `path`'s model with these pool and reader settings (LoadSpec's fields),
        loading it if it is not loaded; a failure is a LoadError."""
        return self.turn_to(LoadSpec(Path(path), **settings))

    def turn_to(self, spec: LoadSpec) -> ModelProvider:
        """Run `spec`'s model: the loaded one, another one loaded (kept as it was), or
        loaded beside them within the limits (engine/residents.py)."""
        with self._lock:
            return self.residents.turn_to(spec, time.monotonic(), lambda: ModelProvider(self.stepping))

    def configure(self, **changes) -> None:
        """Change the running model's pools or reader (ModelProvider.configure's keywords);
        its spec says so, so that a later request with another spec changes them back."""
        with self._lock:
            model = self.require_running()
            model.configure(**changes)
            model.spec = replace(model.spec, expert_slots=model.expert_slots, policy=model.policy,
                                 threads=model.threads, page_cache=model.page_cache, overlap=model.overlap)
            self.residents.publish()

    def bad_slots(self) -> int:
        with self._lock:
            return self.require_running().bad_slots()

    def unload(self, path: Optional[Path] = None) -> bool:
        """Unload the model at `path` (None: every model), and what its generations
        carried (a drafter's weights, its conversation cache); the others' pools grow
        back. False when it was not loaded."""
        with self._lock:
            return self.residents.unload(path)

    def limit(self, limits: Limits) -> None:
        """Set the process's residency limits (engine/residents.Limits)."""
        with self._lock:
            self.residents.limit(limits)

    def residency(self) -> Residency:
        """What the engine holds, for any thread: the records published at its latest
        change, each model's pool counters read now."""
        shown, models = self.residents.shown, dict(self.residents.models)
        return replace(shown, models=tuple(
            replace(r, counters=models[r.path].counters().as_dict()) if r.path in models else r
            for r in shown.models))

    # -- the same, in turn with the generations -----------------------------------------
    def queue_unload(self, path: Optional[Path], unless: Callable[[], bool] = lambda: False) -> Generation:
        """Queue `unload(path)`, skipped if `unless()` is true when its turn comes (the
        server: a request for the model came meanwhile)."""

        def job(out: Channel) -> None:
            if not unless():
                self.unload(path)
            out.put("done", None)

        return worker.submit(job)

    def queue_limit(self, limits: Limits) -> Generation:
        """Queue `limit(limits)` (a server at its start and its stop)."""

        def job(out: Channel) -> None:
            self.limit(limits)
            out.put("done", None)

        return worker.submit(job)

    def run(self, load: LoadSpec | None, request: Request) -> Generation:
        """Queue "load `load` if needed (None: whatever is loaded), then generate `request`".

        Returns at once; the handle yields mlx-lm GenerationResponses as the engine
        thread produces them, raises what the load or the generation raised, and then
        holds the figures in `stats`. Requests run one at a time, in order.
        """
        with self._count_lock:
            self.queued += 1
        return worker.submit(lambda out: self._serve(load, request, out), tag=(load, request))

    def queue_load(self, load: LoadSpec) -> Generation:
        """Queue "load `load` if needed" on its own (a server's warm start, a pool
        rebuild, a prompt that needs the tokenizer), in turn with the generations;
        the handle's `tokenizer` is the loaded checkpoint's, and iterating it waits
        for the load, raises what the load raised and then ends."""

        def job(out: Channel) -> None:
            with self._lock:
                out.check_cancelled()
                model = self.turn_to(load)
                out.put("started", Started(model.tokenizer, model.checkpoint, [], 0))
            out.put("done", None)

        return worker.submit(job)

    def tokenizer_for(self, load: LoadSpec) -> Generation:
        """A handle whose `tokenizer` renders prompts for `load`'s checkpoint: at once
        when that checkpoint is loaded, else once the engine thread has loaded it."""
        model = self.residents.models.get(Path(load.path).expanduser().resolve())
        loaded = model.loaded if model is not None else None
        if loaded is not None:
            ready = Generation()
            ready.started, ready.done = Started(loaded.tokenizer, loaded.path, [], 0), True
            return ready
        return self.queue_load(load)

    def _serve(self, load: LoadSpec | None, request: Request, out: Channel) -> None:
        """One request, on the engine thread, under the lock."""
        with self._count_lock:
            self.queued -= 1
        with self._lock:
            out.check_cancelled()
            model = self.turn_to(load) if load is not None else self.require_running()
            if model.stepping.batches and alone_reason(request, model.loaded.model) is None:
                return self._batch(load, request, out)
            stats = respond(model, request, out, model.carried, self.max_tokens)
            self.finished(stats)
            out.put("done", stats)

    def finished(self, stats: dict) -> None:
        """A generation ran to its end with these figures."""
        self.last_stats, self.last_decode_tps = stats, stats["decode_tps"]
        self.served += 1
        self.generated += stats["generated_tokens"]
        self.residents.publish()  # its prompt cache as the generation left it
        ACTIVITY.finished(stats)

    def _batch(self, load: LoadSpec | None, request: Request, out: Channel) -> None:
        """Decode `request` in a batch that the requests queued behind it join while
        there is room and they can (engine/batch.py); a job that cannot join waits
        until the batch is done, so jobs still run in order."""
        capacity = request.max_batch

        def joins(tag) -> bool:
            if tag is None or len(running.members) >= capacity:
                return False
            their_load, theirs = tag
            return ((their_load is None or their_load == load) and theirs.max_batch > len(running.members)
                    and alone_reason(theirs, running.model.loaded.model) is None)

        running = Batch(self, capacity)
        running.admit(request, out)
        try:
            while running.members:
                while (taken := worker.take_queued(joins)) is not None:
                    with self._count_lock:
                        self.queued -= 1
                    admit_or_refuse(running, taken[0][1], taken[1])
                self.batch = len(running.members)
                self.largest_batch = max(self.largest_batch, self.batch)
                running.step()
        except BaseException as e:
            running.fail(e)
            raise
        finally:
            self.batch = 0
            running.close()

    def metrics(self) -> dict:
        return figures.engine_figures(self)


_manager = worker.Once(EngineManager)


def get_manager() -> EngineManager:
    """The process-wide engine."""
    return _manager()


def use_manager(engine: EngineManager) -> None:
    """Make `engine` the process-wide one (a pipeline's rank 0), before anything used it."""
    _manager.set(engine)
