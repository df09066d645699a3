"""Split a reply's streamed text into answer text, reasoning and tool calls.

A reply can hold ``<think>...</think>`` reasoning (shown by llm on stderr, hidden by
``-R``) and tool-call markup (``<tool_call>...</tool_call>`` or whatever the model's
tool parser in mlx-lm names): the markup is not text for the user, it is parsed
into a tool call once its closing tag has arrived. The detokenizer hands out
arbitrary text segments, so a tag can arrive split across segments; the splitter
holds back a possible partial tag until the next segment decides it. Tags are never
emitted. Inside reasoning, tool-call tags are just reasoning.
"""

from __future__ import annotations

from typing import Optional

from ..stops import partial_suffix

TEXT, REASONING, TOOL = "text", "reasoning", "tool_call"
TOOL_TEXT = "tool_call_text"  # a piece of tool-call markup as it arrives (the block follows whole)
UNFINISHED_TOOL = "tool_call_unfinished"  # markup cut off by the end of the reply


class ReplySplitter:
    """`feed(text)` -> [(kind, chunk)]: "text" and "reasoning" pieces as they become
    certain, the pieces of a tool-call block ("tool_call_text") as they do, and
    ("tool_call", inner markup) once the block is closed."""

    def __init__(self, think_start: Optional[str], think_end: Optional[str], reasoning: bool = False,
                 tool_start: Optional[str] = None, tool_end: Optional[str] = None):
        self.closing: dict[str, str] = {}
        self.opening: dict[str, str] = {}
        if think_start and think_end:
            self.opening[think_start] = REASONING
            self.closing[REASONING] = think_end
        if tool_start and tool_end:
            self.opening[tool_start] = TOOL
            self.closing[TOOL] = tool_end
        self.state = REASONING if reasoning and REASONING in self.closing else TEXT
        self._pending = ""
        self._tool = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        buf = self._pending + text
        self._pending = ""
        while buf:
            if self.state == TEXT:
                found = min(((buf.find(tag), tag) for tag in self.opening if tag in buf), default=None)
                if found is not None:
                    at, tag = found
                    if at:
                        out.append((TEXT, buf[:at]))
                    self.state = self.opening[tag]
                    buf = buf[at + len(tag):]
                    continue
                keep = max((partial_suffix(buf, tag) for tag in self.opening), default=0)
            else:
                tag = self.closing[self.state]
                at = buf.find(tag)
                if at >= 0:
                    self._inside(buf[:at], out)
                    if self.state == TOOL:
                        out.append((TOOL, self._tool))
                        self._tool = ""
                    self.state = TEXT
                    buf = buf[at + len(tag):]
                    continue
                keep = partial_suffix(buf, tag)
            certain = buf[: len(buf) - keep]
            if self.state == TEXT:
                if certain:
                    out.append((TEXT, certain))
            else:
                self._inside(certain, out)
            self._pending = buf[len(buf) - keep:]
            break
        return out

    def _inside(self, chunk: str, out: list) -> None:
        if self.state == TOOL:
            self._tool += chunk
            if chunk:
                out.append((TOOL_TEXT, chunk))
        elif chunk:
            out.append((REASONING, chunk))

    def flush(self) -> list[tuple[str, str]]:
        """What is left at the end of the reply; an unclosed tool call comes back as
        ("tool_call_unfinished", its markup so far)."""
        pending, self._pending = self._pending, ""
        if self.state == TOOL:
            markup, self._tool = self._tool + pending, ""
            return [(UNFINISHED_TOOL, markup)]
        return [(self.state, pending)] if pending else []


def opens_thinking(generation_prompt: str, start: Optional[str], end: Optional[str]) -> bool:
    """True when the template's generation prompt already opened a think block."""
    if not (start and end):
        return False
    i = generation_prompt.rfind(start)
    return i >= 0 and generation_prompt.find(end, i) < 0
