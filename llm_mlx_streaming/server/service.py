"""The server's state: the gate, the runtime parameters, the replies it gave, the
model it serves, and its figures. The routes (app.py and each API's routes.py) read it;
turns.py asks it only what its `turns.GateOwner` protocol states.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from typing import Any, Optional

from fastapi import Request

from .. import values
from ..errors import MlxStreamError, SettingsError, one_line
from ..options import registry
from ..options.run_config import configure
from ..options.settings import Options, load_settings
from ..prompt.render import thinking_switch
from .catalog import checkpoint, untagged
from .errors import ApiError
from .fields import unused
from .gate import Gate
from .guard import key_accepted
from .reply_memory import ReplyMemory
from .response_store import ResponseStore
from .runtime import ConfigError, RuntimeConfig, touches_pools
from .turns import Turn, Turns


log = logging.getLogger(__name__)
LOGGED_FIELDS = 256  # distinct field names logged, at most (a client could invent any number)


class Service:
    """The server's state: the gate, the runtime parameters, the replies it gave."""

    def __init__(self, *, default_model: Optional[str] = None, api_key: Optional[str] = None,
                 secret: Optional[str] = None, max_queue: int = 8, hosts: tuple[str, ...] = (),
                 origins: tuple[str, ...] = (), max_batch: int = 1, reply_memory: int, strict: bool = False,
                 aliases: Optional[dict[str, str]] = None, any_model: bool = False,
                 pinned: tuple[str, ...] = (), max_models: Optional[int] = None) -> None:
        self.default_model = default_model
        self.pinned = tuple(pinned)  # model names loaded at start and never unloaded (engine/residents.py)
        _engine().residents.max_models = max_models or load_settings().max_models
        self.aliases = dict(aliases or {})  # a client's model name -> a model served here
        self.any_model = any_model  # every other unknown name: the default model
        self.strict = strict  # an undeclared field is a 400 (fields.py)
        self._logged: set[str] = set()  # fields named in the log already
        self._thinks: dict[str, bool] = {}  # model id -> whether its template has a thinking switch
        self._takes_images: dict[str, bool] = {}  # model id -> whether its checkpoint takes images
        self.hosts, self.origins = tuple(hosts), tuple(origins)  # server/guard.py
        self.api_key, self.secret = api_key, secret
        self.turns = Turns(Gate(max_queue, capacity=max_batch))  # the gate, the replies in flight, their figures
        self.runtime = RuntimeConfig()
        self.replies = ReplyMemory(reply_memory)
        self.responses = ResponseStore(load_settings().max_responses)  # the Responses API's, by id
        self.model_id: Optional[str] = None  # the model last loaded or asked for
        self.rebuilds = 0  # rebuilds queued or running
        self.rebuild_error: Optional[str] = None
        self._tasks: set = set()
        self._unload_timers: dict[str, asyncio.TimerHandle] = {}  # model id -> its idle unload (keep_alive)
        self.unload_due: dict[str, float] = {}  # model id -> when it is unloaded (a time.time())

    # -- requests -------------------------------------------------------------
    async def check_api_key(self, request: Request) -> None:
        """A dependency of every route but /health; async, so no request borrows a worker thread for it."""
        if self.api_key is None:
            return
        if not key_accepted(request.headers, (self.api_key, self.secret)):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY (or x-api-key: KEY)",
                           code="invalid_api_key")

    def model_for(self, name: Optional[str]) -> str:
        """The model id a request's model name stands for (through --model-alias, or with
        --any-model the default model for any name); 404 when none is served. `name:latest`
        is `name`, as in Ollama, whose clients add the tag."""
        default = self.default_model or registry.MODEL_PREFIX
        name = untagged(name)
        name = self.aliases.get(name, name) or default
        try:
            return registry.model_id_for(name)
        except SettingsError:
            if self.any_model:  # the reply names the model that answered
                return registry.model_id_for(registry.default_name() if default == registry.MODEL_PREFIX else default)
            raise ApiError(404, f"the model {name!r} is not served here; see /v1/models (or serve with "
                           "--model-alias NAME=MODEL or --any-model)", code="model_not_found", param="model") from None

    @staticmethod
    def name_of(model_id: str) -> Optional[str]:
        return registry.name_of(model_id)

    def request_options(self, fields: dict) -> dict:
        """A request's options: its `fields` over the runtime parameters of this moment."""
        return self.runtime.for_request(fields)

    def started(self, model_id: str) -> None:
        """A reply started on `model_id`: the model /api/stats names."""
        self.model_id = model_id

    def remember(self, transcript) -> None:
        """A finished reply: its token ids kept for a request that gives it back."""
        self.replies.remember(transcript)

    def accept(self, request: Request, body) -> None:
        """Name the fields of `body` this server does not act on (fields.py); in --strict,
        an undeclared one is a 400."""
        hints, unknown = unused(body)
        if unknown and self.strict:
            raise ApiError(400, f"{unknown[0]}: not a field this server knows (served with --strict; "
                           "docs/server.md lists the fields)", param=unknown[0])
        self.ignore(request, hints + unknown)

    def ignore(self, request: Request, names: list[str]) -> None:
        """`names` were not acted on: the response's header says so, and the log once each."""
        if not names:
            return
        state = request.scope.setdefault("state", {})
        state["ignored"] = [*state.get("ignored", []), *(n for n in names if n not in state.get("ignored", []))]
        for name in names:
            if name not in self._logged and len(self._logged) < LOGGED_FIELDS:
                self._logged.add(name)
                log.warning("mlx-stream: %s %r: accepted, not acted on", request.url.path, name)

    async def context(self, model_id: str) -> Optional[int]:
        """The context `model_id` runs with here (max_context, planned), or None if it cannot be planned."""
        try:
            run = await asyncio.to_thread(configure, self.name_of(model_id), self.runtime.options(), load_settings())
        except MlxStreamError:
            return None
        return run.max_context

    def thinks(self, model_id: str) -> bool:
        """Whether the model's chat template has a thinking switch (prompt/render.thinking_switch)."""
        if model_id not in self._thinks:
            found = checkpoint(model_id)
            self._thinks[model_id] = found is not None and thinking_switch(found.template) is not None
        return self._thinks[model_id]

    def takes_images(self, model_id: str) -> bool:
        """Whether the model's checkpoint is a vision-language model's."""
        if model_id not in self._takes_images:
            self._takes_images[model_id] = registry.takes_images(self.name_of(model_id))
        return self._takes_images[model_id]

    async def load(self, model_id: str) -> None:
        """Load `model_id` in its turn, and return once it is loaded."""
        async with await Turn.take(self.turns):
            self.keep_loaded(model_id)
            self.model_id = model_id
            await self._load_model(model_id)

    async def unload(self, model_id: Optional[str] = None, first: bool = False) -> None:
        """Unload `model_id` (None: every model) in its turn (`first`: right after the run
        now going); the others' pools grow back."""
        async with await Turn.take(self.turns, first=first):
            if model_id is None:
                await asyncio.to_thread(_engine().unload)
            else:
                self.keep_loaded(model_id)
                async for _ in _engine().queue_release(self.path_of(model_id)):
                    pass

    def schedule_unload(self, model_id: Optional[str] = None, first: bool = True) -> None:
        self._spawn(self.unload(model_id, first=first))

    def unload_after(self, model_id: str, seconds: Optional[float]) -> None:
        """Unload `model_id` once `seconds` have passed without another request for it
        (keep_alive; None: the server's keep_alive setting; negative: never)."""
        self.keep_loaded(model_id)
        if seconds is None:  # a pinned model outlives the server's idle time
            seconds = -1 if self.is_pinned(model_id) else values.duration_seconds(load_settings().keep_alive)
        if seconds < 0:
            return
        self._unload_timers[model_id] = asyncio.get_running_loop().call_later(
            seconds, self.schedule_unload, model_id, False)
        self.unload_due[model_id] = time.time() + seconds

    def keep_loaded(self, model_id: str) -> None:
        """A request for `model_id` came: an unload timed by an earlier one's keep_alive is off."""
        timer = self._unload_timers.pop(model_id, None)
        if timer is not None:
            timer.cancel()
        self.unload_due.pop(model_id, None)

    def is_pinned(self, model_id: str) -> bool:
        return model_id in {self.model_for(name) for name in self.pinned}

    def path_of(self, model_id: str):
        found = checkpoint(model_id)
        return found.path.resolve() if found is not None else None

    def resident(self) -> dict[str, Any]:
        """The loaded models by model id (engine/residents.Resident), one id per checkpoint."""
        return {ids[0]: resident for ids, resident in self._loaded()}

    def loaded_ids(self) -> set[str]:
        """Every model id that names a loaded model (an alias of one is loaded too)."""
        return {name for ids, _ in self._loaded() for name in ids}

    def _loaded(self) -> list[tuple[list[str], Any]]:
        """(Every model id that names it, the Resident) of each loaded model."""
        models = dict(_engine().residents.models)  # a copy: the engine thread changes it
        ids: dict[Any, list[str]] = {}
        for model_id in registry.model_ids():
            path = self.path_of(model_id)
            if path in models:
                ids.setdefault(path, []).append(model_id)
        return [(names, models[path]) for path, names in ids.items()]

    def stop(self) -> None:
        """The server stops: every reply in flight ends now (a stream with an error frame
        saying so), and no other starts, so that no request is still running when uvicorn's
        grace period is over (it would cancel it, with a traceback)."""
        self.turns.stop()
        residents = _engine().residents  # a process that goes on (a test, `launch`) holds one model again
        residents.max_models, residents.pinned = 1, set()

    # -- runtime config -------------------------------------------------------
    def config(self) -> dict:
        return {**self.runtime.shown(load_settings()), "rebuilding": self.rebuilds > 0}

    async def change_config(self, changes: Any) -> dict:
        values = self.runtime.validate(changes)
        pools = touches_pools(changes)
        if pools:  # planned with the model the next request would get
            await asyncio.to_thread(self._check_plan, self.model_id or self.model_for(None), values)
        self.runtime.values = values
        if pools and self.model_id and _engine().state == "loaded":
            self.schedule_load(self.model_id)
        return self.config()

    def _check_plan(self, model_id: str, values: dict) -> None:
        """Plan the pools as a request would, so a budget too small is refused now."""
        try:
            configure(self.name_of(model_id), Options.model_validate(values), load_settings())
        except MlxStreamError as e:
            raise ConfigError(str(e)) from None

    def schedule_load(self, model_id: str) -> None:
        """Load `model_id` with the runtime parameters (or rebuild its pools) in the
        background, ahead of the requests already waiting."""
        self.rebuilds += 1  # counted now: /api/stats says so from this moment
        self._spawn(self._load(model_id))

    async def _load(self, model_id: str) -> None:
        try:
            async with await Turn.take(self.turns, first=True):
                self.model_id = model_id
                await self._load_model(model_id)
                self.rebuild_error = None
        except Exception as e:
            self.rebuild_error = one_line(e)
        finally:
            self.rebuilds -= 1

    async def _load_model(self, model_id: str) -> None:
        run = await asyncio.to_thread(configure, self.name_of(model_id), self.runtime.options(), load_settings())
        if self.is_pinned(model_id):
            _engine().residents.pinned.add(run.path.resolve())
        async for _ in _engine().queue_load(run.load):
            pass

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- figures --------------------------------------------------------------
    def stats(self) -> dict:
        from ..engine.figures import layer_figures

        engine = _engine()
        out = engine.metrics()
        out.update({
            "model": self.model_id,
            "rebuilding": self.rebuilds > 0,
            "rebuild_error": self.rebuild_error,
            "server": {"running": self.turns.gate.busy, "queued": self.turns.gate.waiting,
                       "max_queue": self.turns.gate.max_waiting, "served": self.turns.served,
                       "disconnects": self.turns.disconnects, "threads": _thread_pools()},
            "layers": layer_figures(engine.loaded),
            "models": self.models_figures(),
            "model_loads": engine.residents.loads,
        })
        out["caches"]["reply_memory"] = {"entries": len(self.replies), "max_entries": self.replies.size}
        out["caches"]["responses"] = {"entries": len(self.responses), "max_entries": self.responses.size}
        return out

    def models_figures(self) -> list[dict]:
        """Each loaded model: its share of the memory budget (engine/residents.py) and its
        pools' counters since it was loaded (/metrics labels them by model)."""
        residents = _engine().residents
        return [{"model": ids[0], "ids": ids, "memory_bytes": r.held_bytes(), "expert_slots": r.slots, "pinned": r.pinned,
                 "running": r.provider is _engine(), "expires_at": self.unload_due.get(ids[0]),
                 "memory_budget_bytes": residents.budget, "max_models": residents.max_models,
                 "counters": r.provider.counters().as_dict()}
                for ids, r in self._loaded()]


def _thread_pools() -> dict[str, int]:
    """The process's threads by pool (their names without numbers: `asyncio_`, `AnyIO
    worker thread`, `mlxs-read_`): a pool that keeps growing is a leak."""
    from collections import Counter

    return dict(Counter(re.sub(r"\d+", "", t.name) for t in threading.enumerate()))


def _engine():
    from ..engine.manager import get_manager

    return get_manager()
