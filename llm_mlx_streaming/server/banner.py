"""What `llm mlxs serve` tells the person who started it: each model's load while it runs
("loading MODEL...", rewritten on a terminal with the bytes in memory so far), then, once
the loads of the start are over, where things are: the dashboard, the base URL each API's
clients take, the API key's header when one is set, and the models loaded with their
memory.

A thread of its own looks at the server's state (`Service`) and the engine's a few times
a second; it asks the request path nothing and holds no lock.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from ..options.registry import MODEL_PREFIX, model_ids
from ..sizes import format_size

EVERY_SECONDS = 0.25  # how often the state is looked at


def addresses(url: str, api_key: Optional[str]) -> list[str]:
    """Where a user reaches the server, and how."""
    lines = [
        f"  dashboard  {url}/dashboard  (the API reference: {url}/docs)",
        f"  OpenAI     {url}/v1  (OPENAI_BASE_URL: the openai client, Codex, litellm)",
        f"  Anthropic  {url}  (ANTHROPIC_BASE_URL: the anthropic client, Claude Code)",
        f"  Ollama     {url}  (OLLAMA_HOST: the ollama client, Ollama's apps)",
        "  llm        `llm -m mlx-stream ...` in this llm user dir is answered here",
    ]
    if api_key:
        lines.append("  API key    every route but / and /health wants the --api-key, as Authorization: Bearer KEY "
                     "or x-api-key: KEY")
    return lines


def model_line(m: dict) -> str:
    """One loaded model (an entry of `Service.models_figures()`): its memory and pools."""
    slots = m["expert_slots"]
    if isinstance(slots, list):
        slots = f"{min(slots)}-{max(slots)}" if len(set(slots)) > 1 else slots[0]
    memory = "" if m["memory_bytes"] is None else f"{format_size(m['memory_bytes'])}, "
    named = next((i for i in m["ids"] if i != MODEL_PREFIX), m["model"])  # mlx-stream: the default's other name
    return f"{named} ({memory}{slots} expert slots per layer{', pinned' if m['pinned'] else ''})"


def models_line(models: list[dict]) -> str:
    """The models loaded now, and how many more a request may load."""
    others = len(model_ids()) - len({i for m in models for i in m["ids"]})
    loaded = f"{', '.join(model_line(m) for m in models)} loaded" if models else "none loaded yet"
    more = f"; {others} more load on request" if others > 0 else ""
    return f"  models     {loaded}{more}; GET /v1/models lists them"


class Banner:
    """Says, through `say(text, end)`, each load and, once the loads of the start are over,
    where things are; `stop()` ends its thread. `live`: on a terminal, a load's line is
    rewritten with its progress."""

    def __init__(self, service, url: str, api_key: Optional[str], say: Callable[..., None], live: bool,
                 started: Callable[[], bool]) -> None:
        """`started()`: whether the server is up (its start has queued the loads it makes)."""
        self.service, self.url, self.api_key, self.say, self.live = service, url, api_key, say, live
        self.started = started
        self.shown = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mlx-stream-banner", daemon=True)

    def start(self) -> "Banner":
        self._started_at = time.monotonic()  # the start's loads are timed from here
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _watch(self) -> None:
        from ..engine.manager import get_manager

        engine = get_manager()
        while not self.started():  # its start has queued its loads by then (app.py's lifespan)
            if self._stop.wait(EVERY_SECONDS):
                return
        policy, hosting = self.service.policy, self.service.hosting
        first = [policy.model_for(name) for name in hosting.pinned] or \
            ([policy.model_for(None)] if policy.default_model else [])
        load = _Load(", ".join(first), self._started_at) if first else None
        if load is not None:
            self.say(f"loading {load.model}...", end="" if self.live else "\n")
        held = set()
        while True:
            busy = engine.state == "loading" or hosting.rebuilds > 0  # a load queued or running
            if busy and load is None:  # a request's model, loaded on demand
                load = _Load(hosting.model_id or "a model")
                self.say(f"loading {load.model}...", end="" if self.live else "\n")
            elif busy and self.live:
                self.say(f"\rloading {load.model}... {load.progress()}", end="")
            elif not busy:
                try:
                    self._over(load, held)
                except Exception:  # read while the engine thread changed it (or imported mlx-lm): next tick
                    pass
                else:
                    held, load = _loaded(engine), None
            if self._stop.wait(EVERY_SECONDS):
                return

    def _over(self, load: Optional["_Load"], held: set) -> None:
        """The loads are over: the first time, where things are; then the models new since `held`."""
        from ..engine.manager import get_manager

        if load is not None and self.live:
            self.say("")  # the progress line ends
        hosting = self.service.hosting
        if load is not None and hosting.rebuild_error:
            self.say(f"could not load {load.model}: {hosting.rebuild_error}")
        took = f" in {load.seconds():.1f}s" if load is not None else ""
        if not self.shown:
            lines = [f"ready on {self.url}" + (f" (loaded{took})" if took else "") + ":",
                     *addresses(self.url, self.api_key), models_line(self.service.models_figures())]
            for line in lines:
                self.say(line)
            self.shown = True
            return
        new = _loaded(get_manager()) - held
        for m in self.service.models_figures() if new else ():
            if any(hosting.path_of(i) in new for i in m["ids"]):
                self.say(f"loaded {model_line(m)}{took}")


def _loaded(engine) -> set:
    """The paths of the models the engine holds now (its records, for any thread)."""
    return {r.path for r in engine.residency().models}


class _Load:
    """One model's load as it goes: the bytes MLX holds beyond those of its start."""

    def __init__(self, model: str, start: Optional[float] = None) -> None:
        import mlx.core as mx

        self.model = model
        self.start, self.before = start or time.monotonic(), mx.get_active_memory()

    def seconds(self) -> float:
        return time.monotonic() - self.start

    def progress(self) -> str:
        import mlx.core as mx

        return f"{format_size(max(0, mx.get_active_memory() - self.before))} in memory, {self.seconds():.0f}s"
