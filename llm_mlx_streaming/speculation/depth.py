"""How many drafts to verify next: a fixed k, or `auto`, which follows acceptance.

`auto` starts at one draft and moves one step per pass, up to MAX_AUTO: up when every
draft was kept, down when none was, so drafts that never land cost one wasted position
once. At depth 0 nothing is verified, so it watches instead: it asks
the drafter for one token (free for n-gram lookup) and compares it with the token the
plain step produces; after a hit it verifies one draft again. Drafts that keep failing
thus cost one wasted position per pass only until the depth reaches 0.
"""

from __future__ import annotations

MAX_AUTO = 4


class Depth:
    def __init__(self, k):
        self.auto = k == "auto"
        self.k = 1 if self.auto else int(k)

    def __str__(self) -> str:
        return "auto" if self.auto else str(self.k)

    def next(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if not self.auto or drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k + 1, MAX_AUTO)
        elif accepted == 0:
            self.k -= 1

    def watched(self, hit: bool) -> None:
        """At depth 0: whether the drafter's guess matched the token emitted."""
        if self.auto and hit and self.k == 0:
            self.k = 1
