"""The server's parts, put together: its request policy (policy.py), the models it hosts
(hosting.py), the turns through its gate (turns.py), the runtime parameters, the replies
it gave, and its figures. The routes (app.py and each API's routes.py) hand each request
to the answer pipeline (turns.answer), which asks it only what `turns.Host` states.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any, Optional

from ..errors import MlxStreamError
from ..options.run_config import configure
from ..options.settings import Options, load_settings
from .gate import Gate
from .hosting import Hosting
from .policy import RequestPolicy
from .reply_memory import ReplyMemory
from .response_store import ResponseStore
from .runtime import ConfigError, RuntimeConfig, touches_pools
from .turns import Turns


class Service:
    """The server's policy, hosting, turns, runtime parameters and the replies it gave."""

    def __init__(self, *, default_model: Optional[str] = None, api_key: Optional[str] = None,
                 secret: Optional[str] = None, max_queue: int = 8, hosts: tuple[str, ...] = (),
                 origins: tuple[str, ...] = (), max_batch: int = 1, reply_memory: int, strict: bool = False,
                 aliases: Optional[dict[str, str]] = None, any_model: bool = False,
                 pinned: tuple[str, ...] = (), max_models: Optional[int] = None) -> None:
        self.policy = RequestPolicy(default_model=default_model, api_key=api_key, secret=secret, strict=strict,
                                    aliases=aliases, any_model=any_model)
        self.runtime = RuntimeConfig()
        self.hosting = Hosting(self.runtime, self.policy, pinned, max_models)
        self.hosts, self.origins = tuple(hosts), tuple(origins)  # server/guard.py
        self.turns = Turns(Gate(max_queue, capacity=max_batch))  # the gate, the replies in flight, their figures
        self.replies = ReplyMemory(reply_memory)
        self.responses = ResponseStore(load_settings().max_responses)  # the Responses API's, by id

    def stop(self) -> None:
        """The server stops: every reply in flight ends now (a stream with an error frame
        saying so), and no other starts, so that no request is still running when uvicorn's
        grace period is over (it would cancel it, with a traceback); the engine's limits
        are the process's again."""
        self.turns.stop()
        self.hosting.stop()

    async def context(self, model_id: str) -> Optional[int]:
        """The context `model_id` runs with here (max_context, planned), or None if it cannot be planned."""
        try:
            run = await asyncio.to_thread(configure, self.policy.name_of(model_id),
                                          self.runtime.options(self.hosting.path_of(model_id)), load_settings())
        except MlxStreamError:
            return None
        return run.max_context

    # -- runtime config -------------------------------------------------------
    def config(self, model_id: Optional[str] = None) -> dict:
        """The runtime parameters (of `model_id`: its own over every model's)."""
        return {**self.runtime.shown(load_settings(), self.hosting.path_of(model_id)),
                "rebuilding": self.hosting.rebuilds > 0}

    async def change_config(self, changes: Any, model: Optional[str] = None) -> dict:
        """Apply `changes` to every model (`model` None), each loaded one within its share
        of the budget, or to the model named; a pool change rebuilds those loaded now."""
        model_id = self.policy.model_for(model) if model else None
        own = self.hosting.path_of(model_id)
        values = self.runtime.validate(changes, own)
        pools = touches_pools(changes)
        loaded = [h.ids[0] for h in self.hosting.models() if own is None or h.record.path == own]
        if pools:  # planned as a request would be: a budget too small is refused now
            for target in loaded or [model_id or self.hosting.model_id or self.policy.model_for(None)]:
                path = self.hosting.path_of(target)
                every, its = (self.runtime.values, values) if own else (values, self.runtime.models.get(path, {}))
                await asyncio.to_thread(self._check_plan, target, {**every, **its})
        self.runtime.set(values, own)
        if "memory_budget" in changes and own is None:
            self.hosting.budget_changed()
        if pools:
            for target in loaded:
                self.hosting.rebuild(target)
        return self.config(model_id)

    def _check_plan(self, model_id: str, values: dict) -> None:
        try:
            configure(self.policy.name_of(model_id), Options.model_validate(values), load_settings())
        except MlxStreamError as e:
            raise ConfigError(str(e)) from None

    # -- figures --------------------------------------------------------------
    def stats(self) -> dict:
        from ..engine.figures import layer_figures
        from ..engine.manager import get_manager

        engine = get_manager()
        out = engine.metrics()
        out.update({
            "model": self.hosting.model_id,
            "rebuilding": self.hosting.rebuilds > 0,
            "rebuild_error": self.hosting.rebuild_error,
            "server": {"running": self.turns.gate.busy, "queued": self.turns.gate.waiting,
                       "max_queue": self.turns.gate.max_waiting, "served": self.turns.served,
                       "disconnects": self.turns.disconnects, "threads": _thread_pools()},
            "layers": layer_figures(engine.loaded),
            "models": self.models_figures(),
            "model_loads": engine.residency().loads,
        })
        out["caches"]["reply_memory"] = {"entries": len(self.replies), "max_entries": self.replies.size}
        out["caches"]["responses"] = {"entries": len(self.responses), "max_entries": self.responses.size}
        return out

    def models_figures(self) -> list[dict]:
        """Each loaded model: its share of the memory budget (engine/residents.py), the
        options set for it here, and its pools' counters since it was loaded (/metrics
        labels them by model); /api/ps, the dashboard and /metrics read these."""
        limits = self.hosting.limits
        return [{"model": h.ids[0], "ids": list(h.ids), "memory_bytes": h.record.memory_bytes,
                 "expert_slots": h.record.expert_slots, "pinned": h.record.pinned, "running": h.record.running,
                 "expires_at": h.expires_at, "memory_budget_bytes": limits.budget, "max_models": limits.max_models,
                 "options": self.runtime.set_for(h.record.path), "dense_bytes": h.record.dense_bytes,
                 "experts_bytes": h.record.experts_bytes, "slots": h.record.slots, "kv_bytes": h.record.kv_bytes,
                 "counters": h.record.counters}
                for h in self.hosting.models()]


def _thread_pools() -> dict[str, int]:
    """The process's threads by pool (their names without numbers: `asyncio_`, `AnyIO
    worker thread`, `mlxs-read_`): a pool that keeps growing is a leak."""
    from collections import Counter

    return dict(Counter(re.sub(r"\d+", "", t.name) for t in threading.enumerate()))
