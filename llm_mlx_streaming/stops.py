"""Stop sequences: end a generation where its text first contains one of them.

The detokenizer hands out text in arbitrary segments, so a stop sequence can arrive
split over several tokens. The matcher holds back the longest tail that could still
grow into a stop sequence, and releases it once the next segment rules that out (or
the generation ends). The stop sequence itself, and anything after it, is never
released: the reply ends just before it, as llm's other plugins do.
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        """The part of `text` that is certainly reply text; sets `hit` on a stop sequence."""
        if not self.stops or self.hit is not None:
            return text if self.hit is None else ""
        buf = self._held + text
        first = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if first is not None:
            self._held, self.hit = "", first[1]
            return buf[: first[0]]
        keep = max((partial_suffix(buf, s) for s in self.stops), default=0)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """What was held back, at the end of a generation that met no stop sequence."""
        held, self._held = self._held, ""
        return held


def partial_suffix(buf: str, stop: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(buf)), 0, -1):
        if buf.endswith(stop[:n]):
            return n
    return 0
