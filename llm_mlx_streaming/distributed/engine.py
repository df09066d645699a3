"""One engine across ranks, driven from rank 0.

Rank 0 is the engine the plugin and the server use (`PipelineEngine`: the same queue,
lock, `Generation` and cancellation); its models are given rank 0's stepping (`Leading`):
before one loads, and as its generation starts, it broadcasts what it does, and the
other ranks (`follow`, whose model steps by `Following`) do the same on their own layers. Every message is a collective of mlx.distributed. A rank that fails leaves the
group (its process ends), which fails the collective rank 0 waits in at once, so the
request ends with one line naming the rank; a stall is bounded too (distributed/watch.py).
A broken pipeline sets `failed`, so that a serving rank 0 can leave (distributed/launch.py)
and mlx.launch end the others at once.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Optional

from ..engine.generation import Cancelled
from ..engine.kv import KVSpec
from ..engine.manager import EngineManager
from ..engine.provider import EngineError, LoadError, ModelProvider, Stepping
from ..engine.request import LoadSpec, Request
from ..engine.respond import respond
from ..errors import one_line
from .figures import accumulate, rank_figures, totals
from .group import Group, RankLost, lost_peer
from .lockstep import Aborted, Follow, Lead, WaitClock, following_sampler, leading_sampler
from .split import balanced_split, content_fingerprint, layer_range, layer_weights, own_slots, pipeline_hook
from .watch import Heartbeat, watch


class _Rank:
    """What every rank keeps beside its model: the split, its wait clock, its counters;
    `provider` is the model it loaded last."""

    def __init__(self, group: Group) -> None:
        self.group, self.heart = group, Heartbeat()
        self.provider: Optional[ModelProvider] = None
        self.clock, self.split, self.before = WaitClock(), None, None
        self.timed = None  # the model the wait clock is attached to

    def load(self, message: dict, provider: ModelProvider) -> None:
        """Load this rank's layers of the checkpoint `message` names into `provider`, after
        every rank showed the same checkpoint; a rank that differs or fails is named in one line."""
        self.provider = provider
        with self.heart.waiting("load"):
            self._load(message)

    def _load(self, message: dict) -> None:
        path = Path(message["path"])
        try:
            mine = [content_fingerprint(path), None]
        except OSError as e:
            mine = [None, one_line(e)]
        seen = self.group.gather(mine)
        problem = _first_problem(self.group, seen)
        if problem is None:
            self.split = message["split"]
            self.provider.prepare = pipeline_hook(self.group.group, self.split)
            try:
                pools = {**message["pools"], "expert_slots": own_slots(
                    path, message["pools"]["expert_slots"], self.split, self.group.rank)}
                self.provider.load(path, **pools)
                if self.provider.loaded.model is not self.timed:
                    self.clock.attach(self.provider.loaded.model)
                    self.timed = self.provider.loaded.model
            except Exception as e:
                problem = f"{self.group.where(self.group.rank)}: {one_line(e)}"
        problems = [p for p in self.group.gather(problem) if p]
        if problems:
            raise LoadError(problems[0])

    def begin(self) -> None:
        self.before, self.clock.seconds = self.provider.counters(), 0.0

    def figures(self) -> list[dict]:
        mine = rank_figures(self.group.rank, self.group.host, self.provider, self.before,
                            self.clock.seconds, layer_range(self.split, self.group.rank))
        return self.group.gather(mine)


def _first_problem(group: Group, seen: list) -> str | None:
    for rank, (print_, error) in enumerate(seen):
        if error:
            return f"{group.where(rank)}: {error}"
    for rank, (print_, _) in enumerate(seen):
        if print_ != seen[0][0]:
            return (f"the checkpoint on {group.where(rank)} differs from rank 0's "
                    f"(fingerprint {print_} against {seen[0][0]})")
    return None


class InLockstep(Stepping):
    """Every rank steps each generation together, and stops it together at rank 0's word
    between prefill calls, never inside one (each rank's expert groups are its own)."""

    batches = False

    def between_groups(self, out) -> None:
        """Nothing: rank 0's word between calls stops every rank at the same point."""


class Leading(InLockstep):
    """Rank 0's stepping, given to each model its engine loads: a load is every rank's
    (the split, then each rank's own layers and pools), and a generation tells the other
    ranks the request as its first forward is about to run, then steps in lockstep."""

    def __init__(self, engine: "PipelineEngine") -> None:
        self.engine = engine
        self.lead: Lead | None = None  # the generation under way
        self.request: dict | None = None  # what the other ranks are told it is

    def load(self, provider: ModelProvider, spec: LoadSpec) -> None:
        engine = self.engine
        engine._usable()
        try:
            split = balanced_split(layer_weights(spec.path), engine.budgets or [1.0] * engine.group.size)
        except Exception as e:  # CheckpointError, OSError, ValueError: the files or the ranks
            raise LoadError(f"cannot split {spec.path} over {engine.group.size} ranks: {one_line(e)}") from None
        slots = spec.expert_slots
        if isinstance(slots, (list, tuple)):  # a one-machine plan
            slots = list(slots) if engine.budgets is None else {"ranks": engine._plans(spec.path)}
        pools = {"expert_slots": slots, "policy": spec.policy, "threads": spec.threads,
                 "page_cache": spec.page_cache, "packed": spec.packed}
        message = {"op": "load", "path": str(Path(spec.path).expanduser().resolve()),
                   "split": split, "pools": pools}
        engine._say(message)
        engine._guard(lambda: engine.rank.load(message, provider))

    def steps(self, responses):
        """Tells the other ranks the request as its first forward is about to run."""
        engine = self.engine
        engine._say(self.request)
        engine.rank.begin()
        self.lead = Lead(engine.group, responses, engine.rank.heart)
        return self.lead.steps

    def between_chunks(self, out, last: bool) -> None:
        """Rank 0's word after each prefill chunk but the last (whose token has its own)."""
        if not last:
            self.lead.between_chunks(out)


class PipelineEngine(EngineManager):
    """Rank 0's engine: an EngineManager whose loads and generations every rank runs."""

    def __init__(self, group: Group, budgets: list[int] | None = None, restarts: int = 0,
                 last_error: str | None = None, **plan_options) -> None:
        """`budgets`: each host's memory in bytes (rank 0's first); they weigh the split, and
        a request whose pools come from a memory plan gets each rank's own plan
        (distributed/plan.py, with `plan_options` as plan_memory's) in their place.
        `restarts` and `last_error`: how often the supervisor restarted the pipeline, and
        why last, shown in `metrics()`."""
        self.leading = Leading(self)
        super().__init__(self.leading)
        self.group, self.budgets, self.plan_options = group, budgets, plan_options
        self.restarts, self.last_error = restarts, last_error
        self.rank = _Rank(group)
        self.broken: str | None = None
        self.failed = threading.Event()  # set once the pipeline broke (not when shut down)
        self.rank_totals: list[dict] = []  # each rank's counters over the generations served
        self._cache_off = False  # the request asked for the conversation cache
        self._out = None  # the channel of the generation under way
        watch(self.rank.heart, self._stalled)

    def _plans(self, path) -> list[list[int]]:
        from .plan import plan_ranks

        try:
            return [r.plan.slots_per_layer for r in plan_ranks(path, self.budgets, **self.plan_options)]
        except Exception as e:  # PlanError, CheckpointError, OSError: the budget or the files
            raise LoadError(f"cannot plan the ranks' memory: {one_line(e)}") from None

    def _serve(self, load, request: Request, out) -> None:
        self._usable()
        if request.k != 0:
            raise EngineError("speculation does not run across ranks yet: leave k at 0")
        max_tokens = self.max_tokens if request.max_tokens is None else request.max_tokens
        self.leading.request = {"op": "generate", "prompt": [int(t) for t in request.prompt],
                         "max_tokens": max_tokens, "max_context": request.max_context,
                         "kv": [request.kv.bits, request.kv.group_size, request.kv.start],
                         "prefill_step": request.chunk(len(request.prompt))}
        self._cache_off = request.conversation_cache is not None
        request = replace(request, conversation_cache=None, snapshots=None, max_tokens=max_tokens,
                          sampler=leading_sampler(self.group, request.make_sampler()))
        self._out = out
        try:
            with self.rank.heart.waiting("step"):
                self._guard(lambda: super(PipelineEngine, self)._serve(load, request, _Figured(out, self)))
        except BaseException as e:
            lead = self.leading.lead
            if lead is not None and lead.stepping and self.broken is None:
                self._break(f"{self.group.where(0)} failed within a step ({one_line(e)})")
                self.leading.lead = None
            self._end(aborting=True)
            raise
        finally:
            self._out = None

    def run(self, load, request: Request):
        self._usable()  # a stalled pipeline holds the engine thread: refuse at once
        return super().run(load, request)

    def queue_load(self, load: LoadSpec):
        self._usable()
        return super().queue_load(load)

    def _stalled(self, what: str) -> None:
        """The other ranks said nothing for too long: the pipeline is given up, and the
        generation waiting on them fails in one line (the engine thread stays stuck)."""
        self._give_up(f"no word from the other ranks for {what} (a rank or the network is stuck)")

    def ended_elsewhere(self) -> bool:
        """A SIGTERM came, as mlx.launch sends one as soon as another rank ended. The ring
        may never fail a send or recv issued after that rank's socket closed, so a
        generation under way fails here with the line naming the rank (with more than two
        ranks, the others), and rank 0 leaves as after any failure (`leave_when_broken`);
        whether the pipeline is broken now (False: nothing was under way, stop as usual)."""
        if self.broken is None and self._out is not None:
            self._give_up(str(self.group.lost(RuntimeError("mlx.launch ended the pipeline"))))
        return self.broken is not None

    def _give_up(self, line: str) -> None:
        """Break the pipeline with `line`; the generation under way, if any, fails with it."""
        self._break(line)
        out = self._out
        if out is not None:
            out.put("error", EngineError(f"{self.broken}; restart the ranks"))

    def _end(self, aborting: bool) -> None:
        """Say the last word of the generation under way (none on a broken pipeline)."""
        lead, self.leading.lead = self.leading.lead, None
        if lead is not None and self.broken is None:
            self._guard(lambda: lead.end(aborting))

    def metrics(self) -> dict:
        """The engine's figures (rank 0's own) and `ranks`: each rank's since the start."""
        return {**super().metrics(), "ranks": self.rank_totals, "pipeline_error": self.broken,
                "pipeline_restarts": self.restarts, "last_pipeline_error": self.last_error}

    def shutdown(self) -> None:
        """Send every other rank home (they return from `follow`); a broken pipeline
        (whose engine thread may be stuck holding the lock) has none to send."""
        if self.broken is not None:
            return
        with self._lock:
            if self.broken is None:
                self._say({"op": "stop"})
                self.broken = "the pipeline was shut down"

    def _say(self, message: dict) -> None:
        self._guard(lambda: self.group.broadcast(message))

    def _guard(self, action):
        try:
            return action()
        except RankLost as e:
            self._break(str(e))
        except RuntimeError as e:  # a collective, or the pipeline's send and recv, inside a forward
            if not lost_peer(e):
                raise
            self._break(str(self.group.lost(e)))
        raise EngineError(f"{self.broken}; restart the ranks") from None

    def _break(self, line: str) -> None:
        if self.broken is None:
            self.broken = line
        self.failed.set()

    def _usable(self) -> None:
        if self.broken is not None:
            raise EngineError(f"{self.broken}; restart the ranks")


class _Figured:
    """The generation's channel on rank 0: before "done", the other ranks' word ends, and
    the read figures become every rank's total, each rank's own under `ranks`."""

    def __init__(self, out, engine: PipelineEngine) -> None:
        self.out, self.engine = out, engine

    def check_cancelled(self) -> None:
        self.out.check_cancelled()

    def put(self, kind: str, value) -> None:
        if kind == "done":
            self.engine._end(aborting=False)
            ranks = self.engine._guard(self.engine.rank.figures)
            self.engine.rank_totals = accumulate(self.engine.rank_totals, ranks)
            value = {**value, **totals(ranks), "ranks": ranks}
            if self.engine._cache_off:
                value["disk_cache_off"] = "the conversation cache does not run across ranks yet"
        self.out.put(kind, value)


class _Quiet:
    """A following rank's channel: its responses go nowhere, it is never cancelled."""

    def check_cancelled(self) -> None:
        pass

    def put(self, kind: str, value) -> None:
        pass


class Following(InLockstep):
    """A following rank's stepping: its generation steps as rank 0's word says."""

    def __init__(self, lockstep: Follow) -> None:
        self.lockstep = lockstep

    def steps(self, responses):
        return self.lockstep.steps(responses)

    def between_chunks(self, out, last: bool) -> None:
        self.lockstep.between_chunks(out, last)


def follow(group: Group) -> None:
    """A following rank: load and generate as rank 0 says, until it says stop or is gone.

    A failure of this rank ends its process with one line on stderr, so no other rank
    waits on it.
    """
    rank = _Rank(group)
    provider = ModelProvider(Following(Follow(group, rank.heart)))
    watch(rank.heart, lambda what: _leave(group, f"no word from rank 0 for {what}"))
    while True:
        try:
            message = group.broadcast()
        except RankLost:
            return  # rank 0 is gone
        try:
            if message["op"] == "stop":
                return
            if message["op"] == "load":
                try:
                    rank.load(message, provider)
                except LoadError:
                    pass  # rank 0 reports it
                continue
            rank.begin()
            bits, group_size, start = message["kv"]
            request = Request(message["prompt"], max_tokens=message["max_tokens"],
                              max_context=message["max_context"], sampler=following_sampler(group),
                              kv=KVSpec(bits, group_size, start), prefill_step=message["prefill_step"])
            with rank.heart.waiting("step"):
                try:
                    respond(provider, request, _Quiet(), provider.carried, message["max_tokens"])
                except (Aborted, Cancelled):
                    continue
                rank.figures()
        except RankLost:
            return
        except BaseException as e:
            _leave(group, one_line(e))


def _leave(group: Group, line: str) -> None:
    print(f"mlx-stream: {group.where(group.rank)}: {line}", file=sys.stderr, flush=True)
    os._exit(1)
