"""Split streamed text into answer text and ``<think>...</think>`` reasoning.

The detokenizer hands us arbitrary text segments, so a tag can arrive split
across two segments; the splitter holds back a possible partial tag until the
next segment decides it. The tags themselves are not emitted: llm shows
reasoning on stderr (and ``-R`` hides it), text on stdout.
"""

from __future__ import annotations

from typing import Optional


class ThinkSplitter:
    def __init__(self, start: Optional[str], end: Optional[str], reasoning: bool = False):
        self.start = start
        self.end = end
        self.reasoning = bool(reasoning and start and end)
        self._pending = ""

    @property
    def kind(self) -> str:
        return "reasoning" if self.reasoning else "text"

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Return (kind, chunk) pieces that are certain given the text so far."""
        out: list[tuple[str, str]] = []
        buf = self._pending + text
        self._pending = ""
        if not (self.start and self.end):
            return [("text", buf)] if buf else []
        while buf:
            tag = self.end if self.reasoning else self.start
            idx = buf.find(tag)
            if idx >= 0:
                if idx:
                    out.append((self.kind, buf[:idx]))
                self.reasoning = not self.reasoning
                buf = buf[idx + len(tag) :]
                continue
            keep = _partial_suffix(buf, tag)
            if len(buf) > keep:
                out.append((self.kind, buf[: len(buf) - keep]))
            self._pending = buf[len(buf) - keep :]
            break
        return out

    def flush(self) -> list[tuple[str, str]]:
        pending, self._pending = self._pending, ""
        return [(self.kind, pending)] if pending else []


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


def opens_thinking(generation_prompt: str, start: Optional[str], end: Optional[str]) -> bool:
    """True when the template's generation prompt already opened a think block."""
    if not (start and end):
        return False
    i = generation_prompt.rfind(start)
    return i >= 0 and generation_prompt.find(end, i) < 0
