"""What the engine is doing now and has done: the requests in flight, running totals of
every finished generation, and the last responses' figures.

The dashboard (server/dashboard/) and /metrics (server/metrics.py) read it; the engine
thread writes it with a few integer updates per prefill chunk and per token (no host
sync, no lock on the token path: one writer, and readers only copy numbers).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

# time to first token, seconds: the histogram's upper bounds (/metrics)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))
RECENT = 200  # responses kept for the dashboard's table and `llm mlxs stats --live --plot`
_ids = itertools.count(1)


@dataclass
class Flight:
    """One generation in flight."""

    prompt_tokens: int
    reused_tokens: int
    prefill_total: int  # tokens to prefill (the prompt less what the KV cache held)
    prefill_done: int = 0
    generated: int = 0
    prefill_step: int = 0  # tokens per prefill chunk (0: unknown)
    layers: int = 0  # MoE layers of the model
    layer: int = 0  # MoE layers the chunk in progress has gone through
    mixed: float = 0.0  # share of the tiles the mixer before the next MoE layer has done
    id: int = field(default_factory=lambda: next(_ids))
    started: float = field(default_factory=time.time)
    first_token: float | None = None

    @property
    def phase(self) -> str:
        return "decode" if self.first_token is not None else "prefill"

    @property
    def prefill_estimate(self) -> int:
        """Prompt tokens prefilled, counting the chunk in progress by the share of MoE
        layers it has gone through, the mixer before the next one counted as half a layer
        by its tiles (a chunk may be the whole prompt: engine/prefill.py)."""
        if self.first_token is not None or not self.layers or not self.prefill_step:
            return self.prefill_done
        chunk = max(0, min(self.prefill_step, self.prefill_total - self.prefill_done - 1))
        return self.prefill_done + int(chunk * min(self.layer + self.mixed / 2, self.layers) / self.layers)

    def shown(self, now: float) -> dict:
        out = asdict(self)
        out.update(phase=self.phase, seconds=round(now - self.started, 3), prefill_estimate=self.prefill_estimate)
        if self.first_token is not None:
            decode = now - self.first_token
            out["decode_tps"] = round(self.generated / decode, 2) if decode > 0 and self.generated > 1 else None
        return out


@dataclass
class Totals:
    """Sums over every generation that ran to its end."""

    responses: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0  # time to first token
    decode_seconds: float = 0.0  # from the first token to the end
    ttft_buckets: list = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))  # cumulative counts
    ttft_sum: float = 0.0
    reused_from: dict = field(default_factory=lambda: {"memory": 0, "snapshot": 0, "disk": 0})  # tokens by source


class Activity:
    """The process-wide record (`ACTIVITY`), as the engine (one engine thread) writes it."""

    def __init__(self) -> None:
        self.flights: dict[int, Flight] = {}
        self.totals = Totals()
        self.recent: deque[dict] = deque(maxlen=RECENT)
        self.live_generated = 0  # every token generated, also of generations still running
        self.live_prefilled = 0  # every prompt token prefilled, also of prefills still running
        self._finished = 0  # numbers the recent responses
        self.prefilling: Flight | None = None  # the flight whose prompt chunk the MoE layers run now
        self.batch = None  # the running batch (engine/batch.py), which holds its members' KV caches
        self._lock = threading.Lock()  # begin/end/finished only: never per token

    # -- the engine thread ------------------------------------------------------------
    def begin(self, prompt_tokens: int, reused_tokens: int, prefill_total: int, prefill_step: int = 0,
              layers: int = 0) -> Flight:
        flight = Flight(prompt_tokens, reused_tokens, prefill_total, prefill_step=prefill_step, layers=layers)
        with self._lock:
            self.flights[flight.id] = flight
        self.prefilling = flight
        return flight

    def prefilled(self, flight: Flight, done: int, total: int | None = None) -> None:
        """Prefill progress: `done` of the flight's tokens are in the KV cache (mlx-lm's
        `prompt_progress_callback(done, total)`, called per chunk)."""
        done = min(int(done), flight.prefill_total)
        self.prefilling, flight.layer, flight.mixed = flight, 0, 0.0  # the next chunk starts at the first layer
        if done > flight.prefill_done:
            self.live_prefilled += done - flight.prefill_done
            flight.prefill_done = done

    def moe_layer(self, ordinal: int) -> None:
        """A MoE layer ran a prompt chunk (experts/switch.py, any call of more than one token)."""
        flight = self.prefilling
        if flight is not None:
            flight.layer, flight.mixed = ordinal + 1, 0.0

    def mixed(self, share: float) -> None:
        """A mixer has done `share` of its tiles of a prompt chunk (engine/prefill.py)."""
        flight = self.prefilling
        if flight is not None:
            flight.mixed = share

    def token(self, flight: Flight) -> None:
        if flight.first_token is None:
            flight.first_token = time.time()
            self.prefilled(flight, flight.prefill_total)
            if self.prefilling is flight:
                self.prefilling = None
        flight.generated += 1
        self.live_generated += 1

    def end(self, flight: Flight | None) -> None:
        if flight is None:
            return
        if self.prefilling is flight:
            self.prefilling = None
        with self._lock:
            self.flights.pop(flight.id, None)

    def finished(self, stats: dict) -> None:
        """A generation ran to its end with these figures (engine/figures.py)."""
        ttft = stats.get("ttft_seconds")
        seconds = stats.get("seconds") or 0.0
        with self._lock:
            t = self.totals
            t.responses += 1
            for key in ("prompt_tokens", "reused_tokens", "prefilled_tokens", "generated_tokens"):
                setattr(t, key, getattr(t, key) + int(stats.get(key) or 0))
            if stats.get("reused_from") in t.reused_from:
                t.reused_from[stats["reused_from"]] += int(stats.get("reused_tokens") or 0)
            if isinstance(ttft, (int, float)):
                t.prefill_seconds += ttft
                t.decode_seconds += max(0.0, seconds - ttft)
                t.ttft_sum += ttft
                for i, bound in enumerate(TTFT_BUCKETS):
                    if ttft <= bound:
                        t.ttft_buckets[i] += 1
            else:
                t.decode_seconds += seconds
            mb, generated = stats.get("mb_read"), stats.get("generated_tokens") or 0
            self._finished += 1
            self.recent.append({
                "n": self._finished,
                "t": round(time.time(), 3),
                **{k: stats.get(k) for k in ("prompt_tokens", "reused_tokens", "prefilled_tokens",
                                             "generated_tokens", "prefill_tps", "decode_tps", "hit_rate",
                                             "hits", "misses", "mb_read", "syncs_per_token", "ttft_seconds",
                                             "seconds", "finish_reason", "batch", "reused_from", "reuse_note")},
                "mb_read_per_token": round(mb / generated, 4) if isinstance(mb, (int, float)) and generated else None,
            })

    # -- readers ----------------------------------------------------------------------
    def prefilled_now(self) -> int:
        """Prompt tokens prefilled so far, the chunks in progress counted by their layers."""
        with self._lock:
            flights = list(self.flights.values())
        return self.live_prefilled + sum(f.prefill_estimate - f.prefill_done for f in flights)

    def in_flight(self) -> list[dict]:
        now = time.time()
        with self._lock:
            flights = list(self.flights.values())
        return [f.shown(now) for f in sorted(flights, key=lambda f: f.id)]

    def totals_shown(self) -> dict:
        with self._lock:
            t = asdict(self.totals)
        t["prefill_seconds"] = round(t["prefill_seconds"], 4)
        t["decode_seconds"] = round(t["decode_seconds"], 4)
        t["ttft_sum"] = round(t["ttft_sum"], 4)
        t["ttft_buckets"] = dict(zip(("+Inf" if b == float("inf") else b for b in TTFT_BUCKETS), t["ttft_buckets"]))
        return t

    def recent_responses(self, after: int = 0) -> list[dict]:
        """The last finished responses' figures, those numbered above `after`."""
        with self._lock:
            return [r for r in self.recent if r["n"] > after]


ACTIVITY = Activity()
