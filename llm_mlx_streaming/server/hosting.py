"""The models a server hosts: its residency limits, its loads and unloads, and each
model's keep_alive.

The limits (max_models, the pinned models, the memory budget) are given to the engine
at the server's start (`start`) and given back at its stop; the engine holds the models
(engine/residents.py) and this reads them back as immutable records (`models`). A
request holds its model while it runs (`hold`), and the model's keep_alive counts from
the end of its reply, whole or streamed, finished, cut or cancelled (`Held.end`); with
several requests for a model in flight, as in Ollama, the latest request's keep_alive
applies from the end of the last reply. A request that comes for the model cancels a
pending unload, even one whose time ran out and that waits in the engine's queue. Loads, unloads and pool rebuilds go to the
engine's queue, in turn with the generations already queued.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from .. import values
from ..errors import SettingsError, one_line
from ..engine.residents import Limits, ModelRecord
from ..options import registry
from ..options.run_config import configure
from ..options.settings import budget_bytes, load_settings
from .catalog import checkpoint
from .policy import RequestPolicy
from .runtime import RuntimeConfig


@dataclass(frozen=True)
class Hosted:
    """A loaded model as the server shows it (/api/ps, /api/stats, the dashboard, /metrics)."""

    ids: tuple[str, ...]  # every model id that names its checkpoint; it is listed by the first
    record: ModelRecord
    expires_at: Optional[float]  # time.time() it is unloaded at for idleness (None: until told)


class Held:
    """A request's hold on its model, ended once however the request ends; `unloading`
    is the unload a keep_alive 0 started, for a whole reply to wait for."""

    def __init__(self, hosting: "Hosting", path: Optional[Path]) -> None:
        self.hosting, self.path = hosting, path
        self.unloading: Optional[asyncio.Task] = None
        self._ended = False

    def end(self) -> None:
        """The reply ended (whole or streamed, finished, cut or cancelled)."""
        if not self._ended:
            self._ended = True
            self.unloading = self.hosting._released(self.path)


class Hosting:
    """The models this server hosts, through the engine's one residency API."""

    def __init__(self, runtime: RuntimeConfig, policy: RequestPolicy, pinned: tuple[str, ...] = (),
                 max_models: Optional[int] = None) -> None:
        self.runtime, self.policy = runtime, policy
        self.pinned = tuple(pinned)  # model names loaded at start and never unloaded to make room
        self.max_models = max_models
        self.limits = Limits()  # what it gave the engine at its start
        self.model_id: Optional[str] = None  # the model last asked for or loaded
        self.rebuilds = 0  # loads and rebuilds queued or running in the background
        self.rebuild_error: Optional[str] = None
        self._held: Counter = Counter()  # path -> requests for it in flight
        self._asked: Counter = Counter()  # path -> requests for it so far
        self._keep: dict[Path, Optional[float]] = {}  # path -> the latest request's keep_alive seconds
        self._timers: dict[Path, asyncio.TimerHandle] = {}
        self._due: dict[Path, float] = {}  # path -> time.time() of its idle unload
        self._tasks: set = set()

    # -- the server's start and stop ---------------------------------------------------
    def start(self) -> None:
        """Give the engine this server's limits, and load the pinned models (or the default
        one), so that the first requests find them warm."""
        pinned = frozenset(p for p in (self.path_of(self.policy.model_for(n)) for n in self.pinned) if p)
        self.limits = Limits(self.max_models or load_settings().max_models, pinned, self._budget())
        _engine().queue_limit(self.limits)
        for name in self.pinned or ([self.policy.default_model] if self.policy.default_model else []):
            self.rebuild(self.policy.model_for(name))

    def stop(self) -> None:
        """The server stops: no idle unload is left to run, and a process that goes on (a
        test, `llm mlxs launch`) holds its models under the process's own limits again."""
        for path in list(self._timers):
            self._stop_timer(path)
        _engine().queue_limit(Limits())

    def budget_changed(self) -> None:
        """The runtime memory_budget changed: the models share the new one."""
        self.limits = replace(self.limits, budget=self._budget())
        _engine().queue_limit(self.limits)

    def _budget(self) -> Optional[int]:
        try:
            return budget_bytes(self.runtime.options().memory_budget or load_settings().memory_budget)
        except SettingsError:
            return None

    # -- requests ----------------------------------------------------------------------
    def hold(self, model_id: str, keep_seconds: Optional[float]) -> Held:
        """A request for `model_id` came: a pending unload of it is off, none starts before
        the request's `Held.end`, and then the model stays `keep_seconds` (None: the server's
        keep_alive, a pinned model's until told; 0: unloaded; negative: until its room is needed)."""
        path = self.path_of(model_id)
        self.model_id = model_id
        self._stop_timer(path)
        self._held[path] += 1
        self._asked[path] += 1
        self._keep[path] = keep_seconds
        return Held(self, path)

    def _released(self, path: Optional[Path]) -> Optional[asyncio.Task]:
        self._held[path] -= 1
        if self._held[path] > 0 or path is None:  # the end of the last reply in flight times it
            return None
        del self._held[path]
        keep_seconds = self._keep.pop(path, None)
        if keep_seconds is None:
            keep_seconds = -1 if path in self.limits.pinned else values.duration_seconds(load_settings().keep_alive)
        if keep_seconds < 0:
            return None
        asked = self._asked[path]
        if keep_seconds == 0:
            return self._spawn(self._expire(path, asked))
        self._timers[path] = asyncio.get_running_loop().call_later(
            keep_seconds, lambda: self._spawn(self._expire(path, asked)))
        self._due[path] = time.time() + keep_seconds
        return None

    async def _expire(self, path: Path, asked: int) -> None:
        """Unload `path`'s model, unless a request came for it since (`asked`), when its turn comes."""
        self._timers.pop(path, None)
        self._due.pop(path, None)

        def wanted() -> bool:  # read again on the engine thread, as the unload's turn comes
            return self._held[path] > 0 or self._asked[path] != asked

        if not wanted():
            await _done(_engine().queue_unload(path, unless=wanted))

    def _stop_timer(self, path: Optional[Path]) -> None:
        timer = self._timers.pop(path, None)
        if timer is not None:
            timer.cancel()
        self._due.pop(path, None)

    # -- loads and unloads -------------------------------------------------------------
    async def load(self, model_id: str, keep_seconds: Optional[float]) -> None:
        """Load `model_id` (Ollama's request without messages); its keep_alive counts from then."""
        held = self.hold(model_id, keep_seconds)
        try:
            await self._load(model_id)
        finally:
            held.end()

    async def unload(self, model_id: str) -> None:
        """Unload `model_id` in its turn (keep_alive 0 without messages); the others' pools grow back."""
        path = self.path_of(model_id)
        self._stop_timer(path)
        if path is not None:
            await _done(_engine().queue_unload(path))

    def rebuild(self, model_id: str) -> None:
        """Load `model_id` with the runtime parameters of now (or rebuild its pools) in the
        background, in turn with the generations queued (/api/stats says so meanwhile)."""
        self.rebuilds += 1
        self._spawn(self._rebuild(model_id))

    async def _rebuild(self, model_id: str) -> None:
        try:
            await self._load(model_id)
            self.rebuild_error = None
        except Exception as e:
            self.rebuild_error = one_line(e)
        finally:
            self.rebuilds -= 1

    async def _load(self, model_id: str) -> None:
        self.model_id = model_id
        run = await asyncio.to_thread(configure, self.policy.name_of(model_id), self.runtime.options(self.path_of(model_id)),
                                      load_settings())
        await _done(_engine().queue_load(run.load))

    # -- what it hosts -----------------------------------------------------------------
    def path_of(self, model_id: Optional[str]) -> Optional[Path]:
        found = checkpoint(model_id) if model_id else None
        return found.path.resolve() if found is not None else None

    def models(self) -> list[Hosted]:
        """Each loaded model (in the order the models are added): the ids that name it, the
        engine's record, its idle unload."""
        ids: dict[Path, list[str]] = {}
        for model_id in registry.model_ids():
            path = self.path_of(model_id)
            if path is not None:
                ids.setdefault(path, []).append(model_id)
        records = {r.path: r for r in _engine().residency().models}
        return [Hosted(tuple(names), records[path], self._due.get(path)) for path, names in ids.items()
                if path in records]

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _done(handle) -> None:
    """Wait for a queued engine job (its handle raises what it raised)."""
    async for _ in handle:
        pass


def _engine():
    from ..engine.manager import get_manager

    return get_manager()
