"""Every wait on the other ranks bounded in time.

A collective on a dead peer fails at once, but a peer that is alive and stuck (or a
network that stopped carrying packets without closing anything) leaves the collective
waiting forever, inside MLX where no timeout reaches. So each rank notes when it last
heard from the others while it waits on them, and a watch thread acts on a stall:
rank 0 fails the request in one line, another rank leaves.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable

TIMEOUTS = {"step": 300.0, "load": 1800.0}  # seconds without word from the other ranks


class Heartbeat:
    """When this rank last heard from the others, and how long it may wait now."""

    def __init__(self) -> None:
        self.last, self.kind = time.monotonic(), None  # kind None: not waiting on anyone

    @contextmanager
    def waiting(self, kind: str):
        outer, self.kind = self.kind, kind
        self.beat()
        try:
            yield
        finally:
            self.kind = outer
            self.beat()

    def beat(self) -> None:
        self.last = time.monotonic()

    def stalled(self) -> str | None:
        """What this rank has waited for too long ("a step", "a load"), or None."""
        if self.kind is not None and time.monotonic() - self.last > TIMEOUTS[self.kind]:
            return f"{TIMEOUTS[self.kind]:.0f} s within a {self.kind}"
        return None


def watch(heart: Heartbeat, on_stall: Callable[[str], None], every: float = 1.0) -> None:
    """Call `on_stall(what)` once, on a daemon thread, when `heart` stalls."""

    def loop() -> None:
        while True:
            time.sleep(every)
            what = heart.stalled()
            if what is not None:
                on_stall(what)
                return

    threading.Thread(target=loop, name="mlx-stream-rank-watch", daemon=True).start()
