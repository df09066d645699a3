"""The process-wide engine: its loaded models, one generation at a time, live settings.

`llm chat` and Python code that keep a conversation hold on to the same manager, so
the dense weights, the expert pools and the KV cache survive between turns. The
manager is the model provider (engine/provider.py) with the queue in front of it:
every load and generation runs on the engine thread (engine/worker.py) as one
operation under the provider's lock, load the request's checkpoint if it is not
loaded, then generate (engine/respond.py). So a response always runs on, and
reports, the checkpoint it asked for. Several models stay loaded under one memory
budget (engine/residents.py): the engine is the provider of the one that runs.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from .. import syncs
from . import figures, worker
from ..activity import ACTIVITY
from .generation import Channel, Generation, Started
from .provider import ModelProvider
from .request import LoadSpec, Request
from .residents import Residents
from .batch import Batch, admit_or_refuse, alone_reason
from .respond import Carried, respond


class EngineManager(ModelProvider):
    """The model provider, the queue to the engine thread, and what it served."""

    def __init__(self) -> None:
        super().__init__()
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
        self.carried = Carried()
        self.residents = Residents()

    @property
    def drafters(self) -> dict:
        return self.carried.drafters

    def unload(self) -> None:
        """Unload every model, and drop what was kept for each: its drafter holds it (a
        draft model's or MTP head's weights), its conversation cache is opened for its checkpoint."""
        with self._lock:
            self.residents.unload_all(self)
            self.drop_running()

    def drop_running(self) -> None:
        """Unload the model that runs, and what was kept for it, leaving the others loaded."""
        with self._lock:
            super().drop_running()
            self.carried = Carried(warned=self.carried.warned)

    def admit(self, spec: LoadSpec) -> None:
        """Run `spec`'s model: the loaded one, another one loaded (kept as it was), or
        loaded beside them within the memory budget (engine/residents.py)."""
        with self._lock:
            self.residents.admit(self, spec, time.monotonic())

    def queue_release(self, path) -> Generation:
        """Queue "unload the model at `path`" (an idle time ran out, keep_alive 0), in
        turn with the generations; the others' pools grow back."""

        def job(out: Channel) -> None:
            with self._lock:
                self.residents.release(self, path)
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
                self.admit(load)
                out.put("started", Started(self.tokenizer, self.checkpoint, [], 0))
            out.put("done", None)

        return worker.submit(job)

    def tokenizer_for(self, load: LoadSpec) -> Generation:
        """A handle whose `tokenizer` renders prompts for `load`'s checkpoint: at once
        when that checkpoint is loaded, else once the engine thread has loaded it."""
        resident = self.residents.models.get(Path(load.path).expanduser().resolve())
        loaded = resident.provider.loaded if resident is not None else None
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
            if load is not None:
                self.admit(load)
            self.require_loaded()
            if self.batches and alone_reason(request, self.loaded.model) is None:
                return self._batch(load, request, out)
            stats = respond(self, request, out, self.carried, self.max_tokens)
            self.finished(stats)
            out.put("done", stats)

    def finished(self, stats: dict) -> None:
        """A generation ran to its end with these figures."""
        self.last_stats, self.last_decode_tps = stats, stats["decode_tps"]
        self.served += 1
        self.generated += stats["generated_tokens"]
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
                    and alone_reason(theirs, self.loaded.model) is None)

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
